"""The diffusion steps of one process's sessions in one forward (``DiffusionConfig.batch_sessions`` > 1).

The sessions of one serving process share one model and one ``model.step.BatchedStep``: each
session's diffusion stage joins with its reference frame and gets its own ``DiffusionStep`` on a lane
of the shared KV pool (its ring, scales, frame count, positions, rollbacks and seeds stay its own),
then submits each due step and awaits its latent frame. The scheduling -- window, due set, bounded
pending, worker thread, failures -- is ``stages/shared/batcher.py``'s ``SessionBatcher``, shared with the
decoder's batcher.

    batcher = StepBatcher(config.diffusion, preset, weights)     # one per process: session_factory
    step = batcher.join(reference_latent)          # (blocking) a session's lane, its sink pass done
    latent = await batcher.step(step, tokens, seed)  # (C, h, w) float32 numpy
    batcher.leave(step)                            # (blocking) after a forward that holds it

At most ``batch_sessions`` sessions (``join`` refuses the next with a clear error). A session's own
rollback runs under its stage's limiter, so never while its step is in a forward. A step refused on
its own (no session, bad tokens) fails only its session's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from charstream.model.config import get_preset
from charstream.stages.config import DiffusionConfig, cpu_threads
from charstream.stages.shared.batcher import SessionBatcher

if TYPE_CHECKING:
    import torch

    from charstream.model.step import BatchedStep, DiffusionStep


class StepBatcher(SessionBatcher):
    def __init__(self, config: DiffusionConfig, preset: str, weights: str | None = "packaged") -> None:
        if config.tp != 1:
            raise ValueError(f"batched sessions run at diffusion.tp = 1, not {config.tp}")
        self.device = config.device
        super().__init__(config.batch_sessions, config.batch_window_s,
                         cpu_threads(config.threads) if self.device == "cpu" else None, "step-batcher")
        self.config, self.preset, self.weights = config, preset, weights
        self.fp8 = config.fp8_ring()
        self.graphed = config.step.graphed and self.device.startswith("cuda")
        if config.step.fused or config.step.attention == "fp8_window":  # the batched body attends per lane over the ring
            raise ValueError("diffusion.step.fused and step.attention 'fp8_window' are a single session's step: "
                             "not with batch_sessions > 1")
        self.batch: BatchedStep | None = None  # built by the first join

    # -- sessions (blocking: call from a worker thread) ------------------------------------------------

    def join(self, reference_latent: torch.Tensor) -> DiffusionStep:
        """A new session: a lane of the shared pool, its sink frame written from ``reference_latent``."""
        with self.model_lock:
            if self.batch is None:
                self.batch = self._build()
            step = self.batch.open()
            try:
                step.reset_session(reference_latent.to(self.batch.device))
            except BaseException:
                self.batch.close(step)
                raise
        self.opened()
        return step

    def leave(self, step: DiffusionStep) -> None:
        """End a session: a step of it still waiting is dropped; its lane is free after the current forward."""
        self.closed(step)
        with self.model_lock:
            self.batch.close(step)

    def _build(self) -> BatchedStep:
        import torch

        from charstream.kernels.fp8 import FP8_DTYPE
        from charstream.model.step import BatchedStep
        from charstream.model.weights import build_model, resolve_weights

        dtype = torch.bfloat16 if self.device.startswith("cuda") else torch.float32
        model = build_model(get_preset(self.preset), resolve_weights(self.preset, self.weights), torch.device(self.device),
                            dtype, None, self.config.seed)
        return BatchedStep(model, self.max_sessions, FP8_DTYPE if self.fp8 else dtype, self.config.step)

    # -- steps ----------------------------------------------------------------------------------------

    async def step(self, step: DiffusionStep, tokens: np.ndarray, seed: int) -> np.ndarray:
        """The session's next latent frame (C, h, w) float32, from the next forward that takes it."""
        import torch

        return await self.submit(step, (torch.from_numpy(np.array(tokens, dtype=np.float32)), seed))

    def check(self, step: DiffusionStep, item: tuple[torch.Tensor, int]) -> None:
        step.check_step(item[0])

    def forward(self, steps: list[DiffusionStep], items: list[tuple[torch.Tensor, int]]) -> list[np.ndarray]:
        latents = self.batch.step(steps, [tokens for tokens, _ in items], [seed for _, seed in items])
        return list(latents.float().cpu().numpy())
