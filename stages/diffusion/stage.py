"""Diffusion: ``Conditioning`` -> ``Latents``, one autoregressive DiT step (4 passes) per chunk.

Chunk ``n`` of the session is latent frame ``n - first_chunk`` of the generator's KV ring. Setup
encodes the character's reference image with the VAE encoder and writes it as the sink frame.
The noise of chunk ``n`` is seeded by ``(seed, n)``, so a chunk regenerated after a rollback with
the same conditioning is the same chunk.

Turn-start rollback (docs/ARCHITECTURE.md, Turn-start rollback): ``Control(ROLLBACK, chunk=c, epoch=e)`` rewinds the
ring's write pointer so that the next frame generated is chunk ``c + 1``, and data of older epochs
is dropped -- also a chunk whose step was already running when the rollback arrived. A chunk of a
newer epoch than any ROLLBACK seen (the control was overtaken) rolls back implicitly to itself.
Steps and rollbacks run one at a time on the stage's own worker thread (stages/shared/worker.py; torch
releases the GIL), so the event loop keeps serving heartbeats and control meanwhile; with ``diffusion.tp > 1`` the generator is
rank 0 of a TP group (stages/diffusion/tp_group.py) whose other ranks are processes of their own.

Every rank's step is ``model.step.DiffusionStep``: on CUDA with the bf16 model and an FP8 ring,
the fused FP8 body as CUDA graphs (under TP with the all-reduces inside them), captured once after
``reset_session``; on CPU the module body. With a ``batcher`` (``diffusion.batch_sessions`` > 1,
stages/diffusion/batcher.py) the session's step is a lane of the process's shared ``BatchedStep`` instead:
the same chunks, seeds, rollbacks and epochs, its steps submitted to one forward with other sessions'.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np

from charstream.model.config import get_preset
from charstream.stages.base import Stage, StageContext
from charstream.stages.config import DiffusionConfig, cpu_threads
from charstream.stages.shared.metrics import SessionMetrics
from charstream.stages.shared.worker import StageWorker
from charstream.transport.messages import Conditioning, Control, ControlKind, Latents, Message

if TYPE_CHECKING:
    import torch

    from charstream.stages.diffusion.batcher import StepBatcher


STEP_HISTORY = 100_000  # step times kept for the session's percentiles (69 min at 24 chunks/s)


@dataclass
class DiffusionStats:
    generated: int = 0
    stale: int = 0  # conditioning of an older epoch (or finished after a rollback), dropped
    bad: int = 0  # messages that were not valid conditioning, dropped
    rollbacks: int = 0
    frames_rolled_back: int = 0
    context_lost: int = 0  # window frames a rollback could not restore (ring margin exceeded)
    last_step_s: float = 0.0
    step_s: deque[float] = field(default_factory=lambda: deque(maxlen=STEP_HISTORY))  # the latest steps' wall times


def chunk_seed(seed: int, chunk: int) -> int:
    """The noise seed of ``chunk``: the same chunk always draws the same noise."""
    return (seed * 1_000_003 + chunk) % (2**63)


def reference_latent(preset: str, weights: str | None, identity: int, device: str) -> torch.Tensor:
    """The character's reference image (its rest frame) encoded by the preset's VAE encoder."""
    import torch

    from charstream.model.character import reference_frame
    from charstream.model.vae import to_video
    from charstream.model.weights import load_vae

    cfg = get_preset(preset)
    if weights:
        vae = load_vae(cfg, weights)
    else:  # random weights: a seeded random VAE, so a session is still deterministic
        from charstream.model.vae import VideoVAE

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(identity)
            vae = VideoVAE(cfg).eval()
    with torch.inference_mode():
        image = to_video(reference_frame(identity))[None]  # (1, 3, 128, 128) in [-1, 1]
        if image.shape[-2:] != (cfg.height, cfg.width):  # the face is drawn at 128 x 128: scaled to the preset's video
            image = torch.nn.functional.interpolate(image, size=(cfg.height, cfg.width), mode="bilinear")
        return vae.encode_image(image)[0].float().to(device)


class DiffusionStage(Stage):
    name = "diffusion"

    def __init__(self, config: DiffusionConfig, preset: str, weights: str | None = "packaged", identity: int = 0,
                 batcher: StepBatcher | None = None) -> None:
        """``batcher``: the process's shared step batcher (session_factory makes it), for this preset and weights."""
        if batcher is not None and (batcher.preset, batcher.weights, batcher.device) != (preset, weights, config.device):
            raise ValueError(f"the step batcher serves {batcher.preset} ({batcher.weights}) on {batcher.device}, "
                             f"not {preset} ({weights}) on {config.device}")
        self.batcher = batcher
        self.cfg = get_preset(preset)
        self.preset, self.weights, self.identity = preset, weights, identity
        self.device = config.device
        self.dtype = "bfloat16" if self.device.startswith("cuda") else "float32"
        self.seed, self.tp = config.seed, config.tp
        self.fp8 = config.fp8_ring()
        self.options = config.step
        self.devices = list(config.devices)  # per rank (pipeline/runtime/layouts.py)
        # A stream of its own where the session's step is its own (a batched step is the batcher's; TP ranks
        # are one session's, in processes of their own)
        own_stream = self.device.startswith("cuda") and batcher is None and self.tp == 1
        self.worker = StageWorker("diffusion", cpu_threads(config.threads) if self.device == "cpu" else None,
                                  cuda_stream=self.device if own_stream else None)
        self.epoch = 0
        self.first_chunk: int | None = None
        self.generator: Any = None  # model.generator.Generator or stages.tp_group.TPGenerator
        self._stepping = anyio.Lock()  # a batched step (not on the worker) and a rollback never overlap
        self._log = None
        self.stats = DiffusionStats()

    async def setup(self, ctx: StageContext) -> None:
        self._log = ctx.log
        self.cfg.validate(self.tp)  # a bad TP size fails here, with the config's message
        self.metrics = SessionMetrics(ctx.session_id)  # scraped with the serving process (stages/shared/metrics.py)
        path = await self.worker.run(self._load)
        log = ctx.log.info if path else ctx.log.warning
        step = self.diffusion_step
        log("diffusion_ready", preset=self.preset, device=self.device, dtype=self.dtype, tp=self.tp,
            fp8_cache=self.fp8, weights=path or "random", fused_step=step.fused, attention=self.options.attention,
            graphed_step=self.batcher.graphed if self.batcher else step.graphed,
            batched=self.batcher.max_sessions if self.batcher else 1)

    @property
    def diffusion_step(self):
        """Rank 0's ``model.step.DiffusionStep`` (batched: this session's lane of the shared step)."""
        gen = self.generator
        if self.batcher is not None:
            return gen
        return (gen.generator if self.tp > 1 else gen).diffusion

    def _load(self) -> str | None:
        import torch

        from charstream.model.weights import resolve_weights

        path = resolve_weights(self.preset, self.weights)
        dtype = getattr(torch, self.dtype)
        if self.batcher is not None:
            self.reference = reference_latent(self.preset, path, self.identity, self.device)
            self.generator = self.batcher.join(self.reference)  # a DiffusionStep on a lane of the shared pool
            return path
        if self.tp > 1:
            from charstream.stages.diffusion.tp_group import TPGenerator

            devices = self.devices or (
                [self.device] * self.tp if self.device == "cpu" else [f"cuda:{i}" for i in range(self.tp)])
            self.generator = TPGenerator(self.cfg, self.tp, devices, path, self.fp8, dtype, self.seed, self.options)
        else:
            from charstream.model.generator import Generator

            self.generator = Generator(self.cfg, path, self.device, None, dtype, self.fp8, seed=self.seed,
                                       options=self.options)
        self.reference = reference_latent(self.preset, path, self.identity, self.device)
        self.generator.reset_session(self.reference)
        return path

    def _step(self, audio_tokens: np.ndarray, frame: int, seed: int, rewind: bool) -> np.ndarray:
        import torch

        if rewind:  # an implicit rollback: the chunk's epoch is ahead of any ROLLBACK seen
            self._rewind_to(frame)
        latent = self.generator.step(torch.from_numpy(np.array(audio_tokens, dtype=np.float32)), seed)
        return latent.float().cpu().numpy()

    def _rewind_to(self, frame: int) -> None:
        """Make ``frame`` the next frame generated (a no-op if it is not behind the write pointer)."""
        k = self.generator.next_frame - max(frame, 0)
        if k > 0:
            self.stats.frames_rolled_back += k
            self.stats.context_lost += self.generator.rollback(k)

    async def process(self, msg: Message, ctx: StageContext) -> None:
        if not isinstance(msg, Conditioning):
            self._bad(ctx, None, f"unexpected message {type(msg).__name__}")
            return
        expected = (self.cfg.n_audio_tokens, self.cfg.audio_dim)
        tokens = msg.audio_tokens
        if not isinstance(tokens, np.ndarray) or tuple(tokens.shape) != expected or not np.issubdtype(tokens.dtype, np.floating):
            self._bad(ctx, msg.chunk, f"audio tokens {getattr(tokens, 'dtype', type(tokens))}"
                      f"{tuple(getattr(tokens, 'shape', ()))}, expected float{expected}")
            return
        if not np.isfinite(tokens).all():
            self._bad(ctx, msg.chunk, "audio tokens hold NaN or inf")
            return
        if msg.epoch < self.epoch:
            self.stats.stale += 1
            ctx.log.debug("diffusion_stale", chunk=msg.chunk, epoch=msg.epoch, current=self.epoch)
            return
        if self.first_chunk is None:
            self.first_chunk = msg.chunk
        frame = msg.chunk - self.first_chunk
        rewind = msg.epoch > self.epoch
        if frame < 0 or (frame < self.generator.next_frame and not rewind):
            self._bad(ctx, msg.chunk, f"chunk already generated (next is {self.first_chunk + self.generator.next_frame})")
            return
        if rewind:
            ctx.log.info("diffusion_epoch_ahead", chunk=msg.chunk, epoch=msg.epoch, previous=self.epoch)
            self.epoch = msg.epoch
            self.stats.rollbacks += 1
        elif frame > self.generator.next_frame:  # chunks skipped upstream: the ring stays contiguous
            ctx.log.warning("diffusion_chunk_gap", chunk=msg.chunk, expected=self.first_chunk + self.generator.next_frame)
            self.first_chunk = msg.chunk - self.generator.next_frame
            frame = self.generator.next_frame
        started = time.perf_counter()
        seed = chunk_seed(self.seed, msg.chunk)
        if self.batcher is None:
            latent = await self.worker.run(self._step, tokens, frame, seed, rewind)
        else:
            async with self._stepping:  # never beside this session's rollback
                if rewind:
                    self._rewind_to(frame)  # host bookkeeping only
                latent = await self.batcher.step(self.generator, tokens, seed)
        self.stats.last_step_s = time.perf_counter() - started
        self.stats.step_s.append(self.stats.last_step_s)
        self.metrics.observe_step(self.stats.last_step_s)
        if msg.epoch < self.epoch:  # rolled back while this step ran: the next rollback rewinds past it
            self.stats.stale += 1
            return
        self.stats.generated += 1
        msg.trace.stamp("diffusion_done")  # on every chunk: playout budgets a speech placement from these
        await ctx.emit(Latents(msg.session_id, msg.chunk, latent, msg.audio, msg.speaking, msg.epoch, msg.trace,
                               msg.start_frame))

    async def control(self, msg: Control, ctx: StageContext) -> None:
        if msg.kind != ControlKind.ROLLBACK or msg.epoch <= self.epoch or msg.chunk is None:
            return  # an older or already applied rollback changes nothing
        self.epoch = msg.epoch
        self.stats.rollbacks += 1
        if self.first_chunk is None:
            return  # nothing generated yet
        # After the step still running (the worker's or a batched one), the pointer moves back past it.
        async with self._stepping:
            await self.worker.run(self._rewind_to, msg.chunk + 1 - self.first_chunk)
        ctx.log.info("diffusion_rollback", last_committed=msg.chunk, epoch=msg.epoch,
                     next_frame=self.generator.next_frame, context_lost=self.stats.context_lost)

    def _bad(self, ctx: StageContext, chunk: int | None, problem: str) -> None:
        self.stats.bad += 1
        ctx.log.error("diffusion_bad_input", chunk=chunk, problem=problem)

    async def teardown(self) -> None:
        steps = np.array(self.stats.step_s) * 1e3
        if len(steps) and self._log is not None:  # the session's step times, as the stage saw them (thread hop included)
            self._log.info("diffusion_steps", steps=len(steps), step_p50_ms=round(float(np.percentile(steps, 50)), 2),
                           step_p99_ms=round(float(np.percentile(steps, 99)), 2), step_max_ms=round(float(steps.max()), 2),
                           generated=self.stats.generated, rollbacks=self.stats.rollbacks,
                           frames_rolled_back=self.stats.frames_rolled_back, context_lost=self.stats.context_lost)
        try:
            if self.batcher is not None and self.generator is not None:
                await self.worker.run(self.batcher.leave, self.generator)
            close = getattr(self.generator, "close", None)
            if close is not None:
                await self.worker.run(close)
        finally:
            self.generator = None
            self.worker.close()
