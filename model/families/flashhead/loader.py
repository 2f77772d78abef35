"""A FlashHead weights folder, checked from its file headers before anything is allocated, then loaded.

The folder users have (the released ``SoulX-FlashHead-1_3B``)::

    Model_Pro/   config.json + diffusion_pytorch_model.safetensors (or shards + .safetensors.index.json)
    Model_Lite/  the same, for Lite
    VAE_Wan/Wan2.1_VAE.pth                                  Pro's VAE (a torch zip pickle)
    VAE_LTX/     config.json + diffusion_pytorch_model.safetensors   Lite's VAE
    wav2vec2-base-960h/  (here or beside the folder)         facebook/wav2vec2-base-960h, transformers' format

The DiT files hold the original Wan2.1 names plus ``audio_proj.*`` (the audio adapter); the unused
``text_embedding.*`` and ``audio_emb.*`` are accepted and skipped. Which variant a folder holds is read
from the weights (the patch embedding's input channels and kernel), not from its name.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor

from charstream.model.families.base import CheckpointError, CheckpointReport
from charstream.model.families.flashhead.audio import ADAPTER_KEY_MAP, AudioAdapter, SpeechFeatures
from charstream.model.families.flashhead.config import VARIANTS, FlashHeadConfig
from charstream.model.families.flashhead.dit import FlashHeadDiT, checkpoint_key_map

DIT_STEM = "diffusion_pytorch_model"
MODEL_DIRS = {"pro": "Model_Pro", "lite": "Model_Lite"}
WAV_VAE = Path("VAE_Wan") / "Wan2.1_VAE.pth"
LTX_VAE_DIR = "VAE_LTX"
WAV2VEC2_DIR = "wav2vec2-base-960h"
UNUSED_PREFIXES = ("text_embedding.", "audio_emb.")
DTYPE_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
               "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}  # fmt: skip
LOADABLE_DTYPES = ("F32", "BF16", "F16")


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: str  # safetensors' spelling: F32, BF16, ...
    file: Path


def read_safetensors_header(path: Path) -> dict[str, TensorSpec]:
    """Names, shapes and dtypes from a safetensors header; the file's size must cover every tensor."""
    if not path.is_file():
        raise CheckpointError(path, "missing")
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        header_len = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
        if header_len < 0 or 8 + header_len > size:
            raise CheckpointError(path, f"truncated: {size} bytes, shorter than its header")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(path, f"not a safetensors file ({e})") from None
    header.pop("__metadata__", None)
    specs, end = {}, 0
    for name, entry in header.items():
        shape, dtype, (start, stop) = tuple(entry["shape"]), entry["dtype"], entry["data_offsets"]
        if stop - start != math.prod(shape) * DTYPE_BYTES.get(dtype, 0):
            raise CheckpointError(path, f"{name}: {stop - start} bytes for {dtype} {list(shape)}")
        specs[name] = TensorSpec(shape, dtype, path)
        end = max(end, stop)
    if 8 + header_len + end > size:
        raise CheckpointError(path, f"truncated: {size} bytes, its header describes {8 + header_len + end}")
    return specs


def read_weight_files(folder: Path, stem: str = DIT_STEM) -> dict[str, TensorSpec]:
    """Every tensor of a diffusers-style folder: ``stem.safetensors``, or the shards its index names."""
    single, index = folder / f"{stem}.safetensors", folder / f"{stem}.safetensors.index.json"
    if single.is_file():
        return read_safetensors_header(single)
    if not index.is_file():
        raise CheckpointError(folder, f"missing: neither {single.name} nor {index.name}")
    try:
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(index, f"not a safetensors index ({e})") from None
    specs: dict[str, TensorSpec] = {}
    for shard in sorted(set(weight_map.values())):
        specs |= read_safetensors_header(folder / shard)
    for name, shard in weight_map.items():
        if name not in specs or specs[name].file.name != shard:
            raise CheckpointError(folder / shard, f"lacks {name}, which {index.name} places there")
    return specs


def read_torch_pickle(path: Path) -> dict[str, TensorSpec]:
    """Names, shapes and dtypes of a torch zip pickle, memory-mapped (no tensor is read into memory)."""
    if not path.is_file():
        raise CheckpointError(path, "missing")
    try:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as e:  # torch reports a damaged zip in several exception types
        raise CheckpointError(path, f"unreadable ({str(e).splitlines()[0]})") from None
    if isinstance(state, Mapping) and "state_dict" in state:
        state = state["state_dict"]
    if not isinstance(state, Mapping):
        raise CheckpointError(path, f"holds a {type(state).__name__}, not a state dict")
    return {
        name: TensorSpec(tuple(t.shape), str(t.dtype).removeprefix("torch."), path)
        for name, t in state.items()
        if isinstance(t, Tensor)
    }


def unused_shapes(cfg: FlashHeadConfig) -> dict[str, tuple[int, ...]]:
    """The released files' tensors the model does not use: Wan's text embedding and an audio MLP."""
    d, a = cfg.dim, cfg.audio_dim
    return {
        "text_embedding.0.weight": (d, cfg.text_dim), "text_embedding.0.bias": (d,),
        "text_embedding.2.weight": (d, d), "text_embedding.2.bias": (d,),
        "audio_emb.proj.0.weight": (a,), "audio_emb.proj.0.bias": (a,),
        "audio_emb.proj.1.weight": (a, a), "audio_emb.proj.1.bias": (a,),
        "audio_emb.proj.3.weight": (d, a), "audio_emb.proj.3.bias": (d,),
        "audio_emb.proj.4.weight": (d,), "audio_emb.proj.4.bias": (d,),
    }  # fmt: skip


def used_shapes(cfg: FlashHeadConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> shape of every tensor the DiT and the audio adapter load."""
    with torch.device("meta"):
        dit, adapter = FlashHeadDiT(cfg), AudioAdapter(cfg)
    ours = dict(dit.named_parameters())
    shapes = {theirs: tuple(ours[name].shape) for name, theirs in checkpoint_key_map(cfg.n_blocks).items()}
    adapter_params = dict(adapter.named_parameters())
    return shapes | {theirs: tuple(adapter_params[name].shape) for name, theirs in ADAPTER_KEY_MAP.items()}


def detect_variant(specs: Mapping[str, TensorSpec], where: Path) -> str:
    """The variant, "pro" or "lite", from the patch embedding: (d, 32, 1, 2, 2) or (d, 256, 1, 1, 1)."""
    spec = specs.get("patch_embedding.weight")
    if spec is None:
        raise CheckpointError(where, "no patch_embedding.weight: not a FlashHead DiT")
    for variant, cfg in VARIANTS.items():
        if spec.shape[1:] == (cfg.in_channels, *cfg.patch):
            return variant
    known = ", ".join(f"{v} (d, {c.in_channels}, {', '.join(map(str, c.patch))})" for v, c in VARIANTS.items())
    raise CheckpointError(spec.file, f"patch_embedding.weight is {list(spec.shape)}: neither {known}")


def config_from_folder(folder: Path, variant: str) -> FlashHeadConfig:
    """The variant's config at the depth its config.json states; other sizes must be FlashHead's."""
    path = folder / "config.json"
    if not path.is_file():
        raise CheckpointError(path, "missing")
    try:
        stated = json.loads(path.read_text())
        layers = int(stated["num_layers"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise CheckpointError(path, f"not a FlashHead config ({e})") from None
    cfg = VARIANTS[variant].with_(n_blocks=layers)
    for key, ours in (("dim", cfg.dim), ("num_heads", cfg.n_heads), ("ffn_dim", cfg.ffn_dim), ("in_dim", cfg.in_channels)):
        if key in stated and stated[key] != ours:
            raise CheckpointError(path, f"{key} {stated[key]}, FlashHead {variant} has {ours}")
    return cfg


def compare(cfg: FlashHeadConfig, specs: Mapping[str, TensorSpec], weights: Path) -> CheckpointReport:
    used, unused = used_shapes(cfg), unused_shapes(cfg)
    missing = sorted(set(used) - set(specs))
    mismatched = []
    for name, spec in sorted(specs.items()):
        need = used.get(name)
        if need is not None and spec.shape != need:
            mismatched.append(f"{name}: {list(spec.shape)} in {spec.file.name}, the model needs {list(need)}")
        elif need is not None and spec.dtype not in LOADABLE_DTYPES:
            mismatched.append(f"{name}: {spec.dtype} in {spec.file.name}, the model loads {'/'.join(LOADABLE_DTYPES)}")
    unexpected = sorted(n for n in specs if n not in used and not n.startswith(UNUSED_PREFIXES))
    return CheckpointReport(
        family=cfg.name,
        variant=cfg.variant,
        weights=str(weights),
        files=tuple(sorted({str(s.file) for s in specs.values()})),
        params=sum(math.prod(s) for s in used.values()),
        stored_params=sum(math.prod(s.shape) for s in specs.values()),
        tensors=len(specs),
        missing=tuple(missing),
        mismatched=tuple(mismatched),
        unexpected=tuple(unexpected),
        ignored=tuple(sorted(n for n in specs if n in unused or n.startswith(UNUSED_PREFIXES))),
    )


def find_wav2vec2(root: Path, given: str | Path | None) -> Path:
    if given is not None:
        return Path(given)
    for candidate in (root / WAV2VEC2_DIR, root.parent / WAV2VEC2_DIR):
        if candidate.is_dir():
            return candidate
    raise CheckpointError(root / WAV2VEC2_DIR, f"missing: the audio encoder (facebook/{WAV2VEC2_DIR}), here or beside the folder")


def inspect_wav2vec2(folder: Path, cfg: FlashHeadConfig) -> list[Path]:
    """The audio encoder's config (wav2vec2-base sizes) and a complete weights file."""
    path = folder / "config.json"
    if not path.is_file():
        raise CheckpointError(path, "missing")
    stated = json.loads(path.read_text())
    sizes = (stated.get("hidden_size"), stated.get("num_hidden_layers"))
    if sizes != (cfg.audio_dim, cfg.audio_layers):
        raise CheckpointError(path, f"hidden_size, num_hidden_layers {sizes}: FlashHead reads wav2vec2-base ({cfg.audio_dim}, {cfg.audio_layers})")
    if (folder / "model.safetensors").is_file():
        read_safetensors_header(folder / "model.safetensors")
        return [path, folder / "model.safetensors"]
    read_torch_pickle(folder / "pytorch_model.bin")
    return [path, folder / "pytorch_model.bin"]


def inspect_vae(root: Path, variant: str) -> list[Path]:
    """The variant's VAE file is present and complete (its tensors are the VAE's own to check)."""
    if variant == "pro":
        read_torch_pickle(root / WAV_VAE)
        return [root / WAV_VAE]
    folder = root / LTX_VAE_DIR
    if not (folder / "config.json").is_file():
        raise CheckpointError(folder / "config.json", "missing")
    read_weight_files(folder)
    return [folder]


def inspect_folder(
    root: str | Path, variant: str, audio_encoder: str | Path | None = None
) -> tuple[CheckpointReport, FlashHeadConfig]:
    """Check a released weights folder for ``variant`` from its headers: the DiT's tensors by name, shape
    and dtype; the VAE's and wav2vec2's files complete. Raises ``CheckpointError`` for a missing,
    truncated or unreadable file, or a folder holding the other variant."""
    root = Path(root)
    if not root.is_dir():
        raise CheckpointError(root, "missing: not a folder")
    folder = root / MODEL_DIRS[variant]
    if not folder.is_dir():
        raise CheckpointError(folder, "missing")
    specs = read_weight_files(folder)
    held = detect_variant(specs, folder)
    if held != variant:
        raise CheckpointError(folder, f"holds FlashHead {held.title()} weights, not {variant.title()}")
    cfg = config_from_folder(folder, variant)
    report = compare(cfg, specs, folder)
    extra = inspect_vae(root, variant) + inspect_wav2vec2(find_wav2vec2(root, audio_encoder), cfg)
    files = tuple(str(p) for p in extra) + report.files
    return replace(report, files=files), cfg


def random_checkpoint(cfg: FlashHeadConfig, seed: int, device: torch.device | str = "cpu") -> dict[str, Tensor]:
    """Seeded random fp32 weights in the checkpoint's names and shapes, the unused tensors included:
    linear and conv weights N(0, 1/fan_in), biases N(0, 0.02^2), norm weights 1 + N(0, 0.1^2),
    modulation tables N(0, 1/d) (the released model's initialisation)."""
    generator = torch.Generator(device).manual_seed(seed)
    state = {}
    for name, shape in sorted((used_shapes(cfg) | unused_shapes(cfg)).items()):
        t = torch.randn(shape, generator=generator, device=device)
        if name.endswith("modulation"):
            t /= math.sqrt(cfg.dim)
        elif len(shape) >= 2:
            t /= math.sqrt(math.prod(shape[1:]))
        elif name.endswith("bias"):
            t *= 0.02
        else:  # a norm's weight
            t = 1 + 0.1 * t
        state[name] = t
    return state


class SafetensorsState(Mapping[str, Tensor]):
    """The tensors of header-checked files, each read only when asked for."""

    def __init__(self, specs: Mapping[str, TensorSpec]) -> None:
        self._specs = specs

    def __getitem__(self, name: str) -> Tensor:
        with safe_open(str(self._specs[name].file), framework="pt", device="cpu") as f:
            return f.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)


@dataclass
class FlashHeadModel:
    cfg: FlashHeadConfig
    dit: FlashHeadDiT
    adapter: AudioAdapter
    speech: SpeechFeatures


def build(cfg: FlashHeadConfig, state: Mapping[str, Tensor], device: torch.device | str, dtype: torch.dtype) -> tuple[FlashHeadDiT, AudioAdapter]:
    """The DiT and the adapter, allocated once on ``device`` in ``dtype`` and filled from ``state``."""
    return build_dit(cfg, state, device, dtype), build_adapter(cfg, state, device, dtype)


def build_dit(cfg: FlashHeadConfig, state: Mapping[str, Tensor], device: torch.device | str, dtype: torch.dtype) -> FlashHeadDiT:
    """The DiT alone (the diffusion stage's part of the checkpoint), filled from ``state``."""
    with torch.device("meta"):
        dit = FlashHeadDiT(cfg)
    dit = dit.to(dtype).to_empty(device=device)
    dit.load_checkpoint_state(state)
    return dit.eval()


def build_adapter(cfg: FlashHeadConfig, state: Mapping[str, Tensor], device: torch.device | str, dtype: torch.dtype) -> AudioAdapter:
    """The audio adapter alone (the conditioning stage's part of the DiT checkpoint), filled from ``state``."""
    with torch.device("meta"):
        adapter = AudioAdapter(cfg)
    adapter = adapter.to(dtype).to_empty(device=device)
    with torch.no_grad():
        params = dict(adapter.named_parameters())
        for ours, theirs in ADAPTER_KEY_MAP.items():
            params[ours].copy_(state[theirs])
    return adapter.eval()


def load_wav2vec2(folder: Path, device: torch.device | str) -> SpeechFeatures:
    """wav2vec2 in fp32 whatever the DiT's dtype, as the released pipeline runs it (95 M parameters)."""
    from transformers import Wav2Vec2Model  # a heavy import, needed only here

    model, info = Wav2Vec2Model.from_pretrained(folder, local_files_only=True, output_loading_info=True)
    missing = [k for k in info["missing_keys"] if k != "masked_spec_embed"]  # masked_spec_embed: training only
    if missing:
        raise CheckpointError(folder, f"{len(missing)} audio encoder tensors missing (first: {missing[0]})")
    return SpeechFeatures(model.to(device, torch.float32))


def random_wav2vec2(seed: int, device: torch.device | str) -> SpeechFeatures:
    """wav2vec2-base's sizes with seeded random weights: N(0, 1/fan_in) matrices, unit norm gains, small
    biases (drawn directly: the library's own initialisation takes seconds on a CPU)."""
    from transformers import Wav2Vec2Config, Wav2Vec2Model

    with torch.device("meta"):
        model = Wav2Vec2Model(Wav2Vec2Config())  # the defaults are wav2vec2-base's sizes
    model = model.to_empty(device=device)
    generator = torch.Generator(device).manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.state_dict(keep_vars=True).items()):
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=generator, device=device) / math.sqrt(p[0].numel()))
            elif "norm" in name and name.endswith("weight"):
                p.fill_(1.0)
            else:
                p.copy_(0.02 * torch.randn(p.shape, generator=generator, device=device))
    return SpeechFeatures(model.to(torch.float32))


def load_flashhead(
    weights: str | Path,
    variant: str,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    audio_encoder: str | Path | None = None,
    cfg: FlashHeadConfig | None = None,
) -> FlashHeadModel:
    """The model from a released weights folder (checked first), or ``weights="random"``: seeded random
    weights of ``cfg`` (default: the variant's real config)."""
    cfg, state, speech = _sources(weights, variant, device, seed, audio_encoder, cfg)
    dit, adapter = build(cfg, state, device, dtype)
    return FlashHeadModel(cfg, dit, adapter, speech())


def load_dit(
    weights: str | Path,
    variant: str,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    audio_encoder: str | Path | None = None,
    cfg: FlashHeadConfig | None = None,
) -> FlashHeadDiT:
    """What the diffusion stage runs: the DiT alone, from the same folder or seeded random weights as
    ``load_flashhead`` (no wav2vec2: the conditioning stage loads that, ``load_audio_side``)."""
    cfg, state, _ = _sources(weights, variant, device, seed, audio_encoder, cfg)
    return build_dit(cfg, state, device, dtype)


def load_audio_side(
    weights: str | Path,
    variant: str,
    device: torch.device | str = "cpu",
    seed: int = 0,
    audio_encoder: str | Path | None = None,
    cfg: FlashHeadConfig | None = None,
) -> tuple[AudioAdapter, SpeechFeatures]:
    """What the conditioning stage runs, without the DiT: the adapter (fp32) and wav2vec2, from the same
    folder or seeded random weights as ``load_flashhead`` (the same adapter for the same seed)."""
    cfg, state, speech = _sources(weights, variant, device, seed, audio_encoder, cfg)
    return build_adapter(cfg, state, device, torch.float32), speech()


def _sources(weights: str | Path, variant: str, device: torch.device | str, seed: int,
             audio_encoder: str | Path | None, cfg: FlashHeadConfig | None,
             ) -> tuple[FlashHeadConfig, Mapping[str, Tensor], Callable[[], SpeechFeatures]]:
    """The config, the DiT checkpoint's tensors (read on demand from files) and a wav2vec2 loader."""
    if str(weights) == "random":
        cfg = cfg or VARIANTS[variant]
        return cfg, random_checkpoint(cfg, seed, device), lambda: random_wav2vec2(seed, device)
    report, cfg = inspect_folder(weights, variant, audio_encoder)
    if not report.ok:
        raise CheckpointError(report.weights, report.problem())
    folder = find_wav2vec2(Path(weights), audio_encoder)
    return cfg, SafetensorsState(read_weight_files(Path(report.weights))), lambda: load_wav2vec2(folder, device)
