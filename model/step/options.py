"""The diffusion step's options: one frozen value, from the config (``diffusion.step``) through the stage,
the TP group, the batcher, the engine and ``Generator`` to every rank's ``DiffusionStep``.

Plain data (no torch): the config reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from charstream.config_checks import CheckedSection, within

# The full window's attention backends (model/step/attention.py); while the window fills every step
# attends in place over the ring.
ATTENTIONS = ("ring", "gathered", "fp8_window")


@dataclass(frozen=True)
class StepOptions(CheckedSection):
    SECTION = "diffusion.step"

    # the fused FP8 body (model/step/fused.py); None: where it was built for -- CUDA, a bf16 model, an FP8 ring
    fused: bool | None = None
    # the fused body as CUDA graphs wherever it runs on CUDA (FlashHead's batched denoise: one per batch size);
    # false: eager
    graphed: bool = True
    # once the window is full, on CUDA: "gathered" (the window in bf16 beside the ring, cuDNN's SDPA; faster
    # on the H200, docs/PERF.md), "ring" (in place over the ring, as while it fills) or "fp8_window" (the
    # ring's e4m3 codes, cuDNN's FP8 SDPA: needs nvidia-cudnn-frontend and an FP8 ring)
    attention: str = "gathered"
    # fp8_window: the window's keys in this many partitions (None: chosen from the device's SM count)
    window_splits: int | None = field(default=None, metadata=within(1, 1024))

    def check_together(self) -> None:
        if self.attention not in ATTENTIONS:
            self.refuse("attention", f"must be one of {', '.join(ATTENTIONS)}, got {self.attention!r}")
        if self.window_splits is not None and self.attention != "fp8_window":
            self.refuse("window_splits", f"splits the FP8 window's keys: it needs {self.key('attention')} = 'fp8_window'")


DEFAULTS = StepOptions()  # what serves unless the config says otherwise
