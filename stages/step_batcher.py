"""The diffusion steps of one process's sessions in one forward (``DiffusionConfig.batch_sessions`` > 1).

A ``tiny`` step leaves a GPU nearly idle (a few ms of launches per 166.7 ms chunk), so the sessions
of one serving process share one model and one ``model.step.BatchedStep``: each session's diffusion
stage joins with its reference frame and gets its own ``DiffusionStep`` on a lane of the shared KV
pool (its ring, scales, frame count, positions, rollbacks and seeds stay its own), then submits each
due step and awaits its latent frame. A worker thread (off the event loop) runs one forward for
every step submitted, as soon as each open session has one in, or ``batch_window_s`` after the
first arrived -- and whatever arrives while a forward runs goes into the next, so batches grow with
the load (continuous batching, as vLLM's scheduler does).

    batcher = StepBatcher(config.diffusion, preset, weights)     # one per process: session_factory
    step = batcher.join(reference_latent)          # (blocking) a session's lane, its sink pass done
    latent = await batcher.step(step, tokens, seed)  # (C, h, w) float32 numpy
    batcher.leave(step)                            # (blocking) after a forward that holds it

Bounded: at most ``batch_sessions`` sessions (``join`` refuses the next with a clear error) and one
pending step per session. A session's own rollback runs under its stage's limiter, so never while its
step is in a forward; one that ends while its step waits drops it (the future is cancelled). A
forward that fails fails the future of every session in it; a step refused on its own (no session,
bad tokens) fails only its session's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from charstream.model.config import get_preset
from charstream.stages.config import DiffusionConfig, cpu_threads

if TYPE_CHECKING:
    import torch
    from charstream.model.step import BatchedStep, DiffusionStep


@dataclass
class _Due:
    step: DiffusionStep
    tokens: torch.Tensor
    seed: int
    result: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


@dataclass
class BatcherStats:
    forwards: int = 0
    steps: int = 0  # session steps served
    largest: int = 0  # most steps in one forward


class StepBatcher:
    def __init__(self, config: DiffusionConfig, preset: str, weights: str | None = "packaged") -> None:
        if config.batch_sessions < 2:
            raise ValueError(f"a step batcher needs batch_sessions >= 2, got {config.batch_sessions}")
        if config.tp != 1:
            raise ValueError(f"batched sessions run at diffusion.tp = 1, not {config.tp}")
        if config.batch_window_s < 0:
            raise ValueError(f"batch_window_s must be >= 0, got {config.batch_window_s}")
        self.config, self.preset, self.weights = config, preset, weights
        self.max_sessions, self.window_s = config.batch_sessions, config.batch_window_s
        self.device = config.device
        self.fp8 = self.device.startswith("cuda") if config.fp8_cache is None else config.fp8_cache
        self.graphed = config.graphed_step and self.device.startswith("cuda")
        self.stats = BatcherStats()
        self.batch: BatchedStep | None = None  # built by the first join
        self._forward = threading.Lock()  # the model and pool: one forward, sink pass, join or leave at a time
        self._wake = threading.Condition()  # guards _pending, _open, _worker
        self._pending: list[_Due] = []
        self._open = 0
        self._worker: threading.Thread | None = None

    # -- sessions (blocking: call from a worker thread) ------------------------------------------------

    def join(self, reference_latent: torch.Tensor) -> DiffusionStep:
        """A new session: a lane of the shared pool, its sink frame written from ``reference_latent``."""
        with self._forward:
            if self.batch is None:
                self.batch = self._build()
            step = self.batch.open()
            try:
                step.reset_session(reference_latent.to(self.batch.device))
            except BaseException:
                self.batch.close(step)
                raise
        with self._wake:
            self._open += 1
            if self._worker is None:
                self._worker = threading.Thread(target=self._serve, name="step-batcher", daemon=True)
                self._worker.start()
        return step

    def leave(self, step: DiffusionStep) -> None:
        """End a session: a step of it still waiting is dropped; its lane is free after the current forward."""
        with self._wake:
            for due in [d for d in self._pending if d.step is step]:
                self._pending.remove(due)
                due.result.cancel()
            self._open -= 1
            self._wake.notify()
        with self._forward:
            self.batch.close(step)

    def _build(self) -> BatchedStep:
        import torch
        from charstream.kernels.fp8 import FP8_DTYPE
        from charstream.model.step import BatchedStep
        from charstream.model.weights import build_model, resolve_weights

        dtype = torch.bfloat16 if self.device.startswith("cuda") else torch.float32
        model = build_model(get_preset(self.preset), resolve_weights(self.preset, self.weights), torch.device(self.device),
                            dtype, None, self.config.seed)
        return BatchedStep(model, self.max_sessions, FP8_DTYPE if self.fp8 else dtype, graphed=self.graphed)

    # -- steps ----------------------------------------------------------------------------------------

    async def step(self, step: DiffusionStep, tokens: np.ndarray, seed: int) -> np.ndarray:
        """The session's next latent frame (C, h, w) float32, from the next forward that takes it."""
        import torch

        due = _Due(step, torch.from_numpy(np.array(tokens, dtype=np.float32)), seed)
        with self._wake:
            if any(d.step is step for d in self._pending):
                raise RuntimeError("a session submitted a step while its previous one is pending")
            self._pending.append(due)
            self._wake.notify()
        return await asyncio.wrap_future(due.result)

    def _serve(self) -> None:
        """The worker: take what is due, one forward, hand each session its row; ends with the last session."""
        if self.device == "cpu":  # torch's intra-op setting is per thread
            import torch

            torch.set_num_threads(cpu_threads(self.config.threads))
        while True:
            with self._wake:
                while not self._pending and self._open > 0:
                    self._wake.wait()
                if self._open == 0:
                    self._worker = None
                    return
                deadline = time.monotonic() + self.window_s
                while 0 < len(self._pending) < self._open and (left := deadline - time.monotonic()) > 0:
                    self._wake.wait(left)
                taken, self._pending = self._pending[: self.max_sessions], self._pending[self.max_sessions :]
            self._run([d for d in taken if d.result.set_running_or_notify_cancel()])

    def _run(self, dues: list[_Due]) -> None:
        ready = []
        for due in dues:  # a step refused on its own fails its session only
            try:
                due.step.check_step(due.tokens)
                ready.append(due)
            except Exception as e:  # noqa: BLE001 -- handed to the session that submitted it
                due.result.set_exception(e)
        if not ready:
            return
        try:
            with self._forward:
                latents = self.batch.step([d.step for d in ready], [d.tokens for d in ready], [d.seed for d in ready])
                rows = latents.float().cpu().numpy()
        except Exception as e:  # noqa: BLE001 -- every session of the failed forward hears it
            for due in ready:
                due.result.set_exception(e)
            return
        self.stats.forwards += 1
        self.stats.steps += len(ready)
        self.stats.largest = max(self.stats.largest, len(ready))
        for due, row in zip(ready, rows, strict=True):
            due.result.set_result(row)
