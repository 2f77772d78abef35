"""What every model family offers the serving side: its sizes, its timeline, a checkpoint check that
allocates nothing, and a loader.

A family is one class (``ModelFamily``) per model architecture, instantiated per variant; the registry
(``charstream.model.families.get_family``) names them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

# How a family generates: "kv_ring" steps one latent frame at a time over a KV ring cache (the character
# presets); "chunk_motion" denoises a whole chunk bidirectionally, continuing the previous chunk through
# motion latents re-encoded from its last frames.
GenerationMode = Literal["kv_ring", "chunk_motion"]


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: ``path`` names the file or folder, ``problem`` what is wrong."""

    def __init__(self, path: str | Path, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = Path(path)
        self.problem = problem


@dataclass(frozen=True)
class Timeline:
    fps: int
    new_frames_per_chunk: int  # frames each chunk adds to the stream
    audio_rate: int  # the audio encoder's sample rate


@dataclass(frozen=True)
class CheckpointReport:
    """What a weights folder holds against what a family's variant needs, read from file headers."""

    family: str
    variant: str
    weights: str
    files: tuple[str, ...]
    params: int  # parameters the model loads
    stored_params: int  # every tensor in the files, the unused ones included
    tensors: int
    missing: tuple[str, ...] = ()
    mismatched: tuple[str, ...] = ()  # "name: what the file holds, what the model needs"
    unexpected: tuple[str, ...] = ()
    ignored: tuple[str, ...] = field(default=())  # present in the released files, unused by the model

    @property
    def ok(self) -> bool:
        return not (self.missing or self.mismatched or self.unexpected)

    def problem(self) -> str | None:
        """One line naming what is wrong (the folder is ``weights``), or None."""
        parts = []
        for label, names in (("missing", self.missing), ("mismatched", self.mismatched), ("unexpected", self.unexpected)):
            if names:
                parts.append(f"{len(names)} {label} (first: {names[0]})")
        return "; ".join(parts) if parts else None

    def as_dict(self) -> dict[str, Any]:
        return {
            "family": self.family,
            "variant": self.variant,
            "weights": self.weights,
            "ok": self.ok,
            "problem": self.problem(),
            "params": self.params,
            "stored_params": self.stored_params,
            "tensors": self.tensors,
            "files": list(self.files),
            "missing": list(self.missing),
            "mismatched": list(self.mismatched),
            "unexpected": list(self.unexpected),
            "ignored": len(self.ignored),
        }


class ModelFamily(ABC):
    name: str
    variants: tuple[str, ...]

    @property
    @abstractmethod
    def config(self) -> Any:
        """The variant's frozen config dataclass."""

    @property
    @abstractmethod
    def timeline(self) -> Timeline: ...

    @property
    @abstractmethod
    def generation_mode(self) -> GenerationMode: ...

    @abstractmethod
    def parameter_count(self) -> int:
        """Parameters of the variant's model, counted on the meta device."""

    @abstractmethod
    def inspect(self, weights_dir: str | Path) -> CheckpointReport:
        """Check a weights folder from its file headers (nothing allocated); raises ``CheckpointError`` for a
        file that is missing, truncated or unreadable."""

    @abstractmethod
    def load(self, weights: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0) -> Any:
        """The model from a weights folder, or seeded random weights of the real config (``weights="random"``)."""
