"""What every model family offers the serving side: its sizes, its timeline, a checkpoint check that
allocates nothing, and a loader.

A family is one class (``ModelFamily``) per model architecture, instantiated per variant; the registry
(``charstream.model.families.get_family``) names them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from charstream.timeline import Timeline, ms_samples

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
class AudioConditioner:
    """What the conditioning stage runs for a family: ``encode`` maps one int16 48 kHz window of the
    timeline -- ``context_ms`` before the chunk, the chunk's span, ``lookahead_ms`` after -- to the
    chunk's audio tokens (float32). The stage cuts the windows; the family says how wide they are."""

    encode: Callable[[np.ndarray], np.ndarray]
    context_ms: float
    lookahead_ms: float
    rollback_frames: int | None = None  # how far a turn start may rewind the generator (None: no ring)
    # several sessions' windows at once (the conditioning stage's batcher), where the family can
    encode_batch: Callable[[list[np.ndarray]], list[np.ndarray]] | None = None

    def window_samples(self, timeline: Timeline) -> int:
        """A window's length in samples on the 48 kHz timeline, for chunks of ``timeline``."""
        return ms_samples(self.context_ms) + timeline.samples_per_chunk + ms_samples(self.lookahead_ms)


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


def meta_flops(fn: Callable[[], Any]) -> int:
    """The floating-point operations of ``fn()`` as PyTorch's FLOP counter sees them (matrix products,
    convolutions, attention); ``fn`` builds and runs its modules on the meta device."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"), torch.no_grad(), FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())


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
    def flops_per_chunk(self) -> dict[str, int]:
        """Floating-point operations (a multiply-add is 2) of one chunk of the timeline, by part of the model,
        counted on the meta device (nothing allocated): what a session costs the accelerator per chunk."""

    @abstractmethod
    def inspect(self, weights_dir: str | Path) -> CheckpointReport:
        """Check a weights folder from its file headers (nothing allocated); raises ``CheckpointError`` for a
        file that is missing, truncated or unreadable."""

    @abstractmethod
    def audio_conditioner(self, weights: str | None, device: str = "cpu", seed: int = 0,
                          graphed: bool = True) -> AudioConditioner:
        """The conditioning stage's encoder from ``weights`` (None or ``"random"``: seeded random weights);
        ``graphed``: replayed as a CUDA graph where the family can."""

    @abstractmethod
    def load(self, weights: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0) -> Any:
        """The model from a weights folder, or seeded random weights of the real config (``weights="random"``)."""

    def warm_up(self, weights: str | None, device: str, seed: int = 0, batched: bool = False) -> float:
        """Load and compile what a serving process's sessions share before its first session, so that
        session's first chunk is not late (``batched``: the sessions' work batched too); seconds spent
        (default: nothing is shared, 0)."""
        return 0.0

