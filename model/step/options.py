"""The diffusion step's options: one frozen value, from the config (``diffusion.step``) through the stage,
the TP group, the batcher, the engine and ``Generator`` to every rank's ``DiffusionStep``.

Plain data (no torch): the config reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

# The full window's attention backends (model/step/attention.py); while the window fills every step
# attends in place over the ring.
ATTENTIONS = ("ring", "gathered", "fp8_window")


@dataclass(frozen=True)
class StepOptions:
    # the fused FP8 body (model/step/fused.py); None: where it was built for -- CUDA, a bf16 model, an FP8 ring
    fused: bool | None = None
    # the fused body as CUDA graphs wherever it runs on CUDA; false: eager
    graphed: bool = True
    # once the window is full, on CUDA: "gathered" (the window in bf16 beside the ring, cuDNN's SDPA; faster
    # on the H200, docs/PERF.md), "ring" (in place over the ring, as while it fills) or "fp8_window" (the
    # ring's e4m3 codes, cuDNN's FP8 SDPA: needs nvidia-cudnn-frontend and an FP8 ring)
    attention: str = "gathered"
    # fp8_window: the window's keys in this many partitions (None: chosen from the device's SM count)
    window_splits: int | None = None

    def __post_init__(self) -> None:
        if self.attention not in ATTENTIONS:
            raise ValueError(f"step.attention must be one of {', '.join(ATTENTIONS)}, got {self.attention!r}")
        if self.window_splits is not None:
            if self.attention != "fp8_window":
                raise ValueError("step.window_splits splits the FP8 window's keys: it needs step.attention = 'fp8_window'")
            if self.window_splits < 1:
                raise ValueError(f"step.window_splits must be >= 1, got {self.window_splits}")


DEFAULTS = StepOptions()  # what serves unless the config says otherwise
