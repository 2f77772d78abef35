"""Reading the VAEs' weight files: shapes from the file's index first, then the tensors, one clear error otherwise.

A torch ``.pth`` is a zip archive: its central directory sits at the end, so a truncated file fails to open before
anything is read, and ``torch.load(mmap=True)`` maps the tensors without copying them. A ``.safetensors`` file starts
with a JSON header giving every tensor's shape and byte range, so its size and shapes are checked before loading.
"""

from __future__ import annotations

import json
import struct
import zipfile
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor

from charstream.model.families.flashhead.errors import CheckpointError

_SAFETENSORS_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                            "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def check_shapes(path: Path, found: Mapping[str, tuple[int, ...]], expected: Mapping[str, tuple[int, ...]]) -> None:
    """Raise one ``CheckpointError`` listing the missing, unexpected and mis-shaped tensors (a few of each)."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    wrong = sorted(k for k in set(found) & set(expected) if tuple(found[k]) != tuple(expected[k]))
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing tensor(s), e.g. {', '.join(missing[:3])}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensor(s), e.g. {', '.join(unexpected[:3])}")
    if wrong:
        k = wrong[0]
        problems.append(f"{len(wrong)} tensor(s) of the wrong shape, e.g. {k} is {tuple(found[k])}, "
                        f"expected {tuple(expected[k])}")
    if problems:
        raise CheckpointError(path, "; ".join(problems))


def load_torch_zip(path: Path) -> dict[str, Tensor]:
    """The flat state dict of a torch zip checkpoint, memory-mapped (tensors are read when first used)."""
    if not path.is_file():
        raise CheckpointError(path, "file not found")
    try:
        with zipfile.ZipFile(path) as archive:
            archive.infolist()
    except zipfile.BadZipFile as e:
        raise CheckpointError(path, f"not a complete torch checkpoint (zip archive): {e}") from None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # the unpickler's errors name no file: name it
        raise CheckpointError(path, f"unreadable torch checkpoint: {type(e).__name__}: {e}") from None
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise CheckpointError(path, "not a flat state dict of tensors")
    return state


def safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape from a ``.safetensors`` header, after checking that the file holds all their bytes."""
    if not path.is_file():
        raise CheckpointError(path, "file not found")
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(path, "truncated: no safetensors header")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > size - 8:
            raise CheckpointError(path, "truncated: header longer than the file")
        try:
            header = json.loads(f.read(header_len))
        except ValueError as e:
            raise CheckpointError(path, f"unreadable safetensors header: {e}") from None
    header.pop("__metadata__", None)
    shapes, end = {}, 0
    for name, info in header.items():
        start, stop = info["data_offsets"]
        count = 1
        for n in info["shape"]:
            count *= n
        if info["dtype"] not in _SAFETENSORS_DTYPE_BYTES or stop - start != count * _SAFETENSORS_DTYPE_BYTES[info["dtype"]]:
            raise CheckpointError(path, f"tensor {name}: byte range does not match its dtype and shape")
        shapes[name] = tuple(info["shape"])
        end = max(end, stop)
    if 8 + header_len + end > size:
        raise CheckpointError(path, f"truncated: {size} bytes, the header needs {8 + header_len + end}")
    return shapes
