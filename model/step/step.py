"""The diffusion step of one TP rank: 4 sampler passes of the DiT over the KV ring, the last pass's K/V kept.

    step = DiffusionStep(model, cache, tp_group, StepOptions())
    step.reset_session(reference_latent)   # the sink pass (eager), then the graphs are captured once
    latent = step.step(audio_tokens, seed) # one chunk
    step.rollback(k)                       # turn-start rollback: forget the last k frames

Every rank of every deployment runs this object: ``model/generator.py`` builds it for one rank,
``stages/diffusion/tp_group.py`` on every rank of a TP group, ``charstream bench gpu`` times it. Its body
computes the velocity of one pass -- the module body (model/step/module.py) or the fused body
(model/step/fused.py, attending through a backend of model/step/attention.py); this file holds the
rest: inputs, sampler run, cache bookkeeping, rollback, position reset, capture.

Everything that moves between steps -- ring write pointer, time position, ring validity, window
order, noise, audio -- lives in device tensors the graph reads, and the cache's storage is never
reallocated, so one capture serves a whole session: rollbacks are host bookkeeping, and the position
reset's delta rotation runs in place, outside the graph, in ``KVCache.begin_frame``. The sink pass
(``sink_frames`` frames, a shape no other step has) always runs eagerly through ``DiT.forward``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from charstream.model.cache import KVCache
from charstream.model.dit import DiT
from charstream.model.graphs import capture_graph, one_capture_at_a_time
from charstream.model.rope import frame_positions
from charstream.model.sampler import seeded_noise
from charstream.model.step.attention import (
    Fp8WindowBackend,
    GatheredBackend,
    RingBackend,
    RingWrite,
    StepAttention,
    window_frames_held,
)
from charstream.model.step.fused import FusedBody
from charstream.model.step.inputs import StepInputs
from charstream.model.step.module import LevelModulations, RingSelfAttention, module_body
from charstream.model.step.options import DEFAULTS, StepOptions


def fused_by_default(device: torch.device | str, dtype: torch.dtype, fp8_cache: bool) -> bool:
    """The fused FP8 body serves where it was built for: CUDA, a bf16 model, an FP8 ring."""
    return torch.device(device).type == "cuda" and dtype == torch.bfloat16 and fp8_cache


class DiffusionStep:
    def __init__(self, model: DiT, cache: KVCache, tp_group: dist.ProcessGroup | None = None,
                 options: StepOptions = DEFAULTS) -> None:
        cfg, dev = model.cfg, cache.k.device
        self.model, self.cache, self.cfg, self.tp_group, self.options = model, cache, cfg, tp_group, options
        self.device = dev
        fused = fused_by_default(dev, model.head.weight.dtype, cache.fp8) if options.fused is None else options.fused
        self.fused = fused
        self.graphed = options.graphed and fused and dev.type == "cuda"
        if options.attention == "fp8_window" and not (fused and dev.type == "cuda" and cache.fp8):
            raise ValueError("step.attention 'fp8_window' needs the fused step on CUDA over an FP8 cache")
        # The step's inputs (written before each run; the graph reads them) and its output: a batch of one.
        self.inputs = StepInputs(cfg, 1, dev)
        self.noise, self.audio, self.latent = self.inputs.noise, self.inputs.audio, self.inputs.latent
        self.positions, self.slot = self.inputs.positions[0], self.inputs.slot[0]
        self._session = False
        self.graphs: dict[StepAttention, torch.cuda.CUDAGraph] = {}
        self.ring: StepAttention | None = None  # the fused body's attention while the window fills
        self.full_window: StepAttention | None = None  # and once it is full (None: the ring's still)
        self.body: FusedBody | None = None
        if not fused:
            return
        write = RingWrite(model, cache, self.slot, self.positions)
        self.ring = RingBackend(write)
        if dev.type == "cuda" and options.attention == "gathered":
            self.full_window = GatheredBackend(write, model)
        elif options.attention == "fp8_window":
            self.full_window = Fp8WindowBackend(write, model, options.window_splits)
        self.body = FusedBody(model, self.inputs, tp_group, self.ring)

    @property
    def attention(self) -> StepAttention | None:
        """The fused body's attention backend of the next run (None: the module body's)."""
        return self.body.attention if self.body is not None else None

    @attention.setter
    def attention(self, backend: StepAttention) -> None:
        self.body.attention = backend

    @property
    def window_splits(self) -> int:
        """The full window's key partitions: the FP8 window's, else 1."""
        return self.full_window.splits if isinstance(self.full_window, Fp8WindowBackend) else 1

    @property
    def next_frame(self) -> int:
        """Index (since the session's start) of the frame the next ``step`` generates."""
        return self.cache.next_frame

    def _latent_shape(self) -> tuple[int, int, int]:
        return self.cfg.latent_channels, self.cfg.latent_height, self.cfg.latent_width

    # -- the session --------------------------------------------------------------------------------

    @torch.inference_mode()
    def reset_session(self, reference_latent: torch.Tensor) -> None:
        """Start a session: the reference latent (C, h, w) becomes the sink frame(s), clean (sigma 0).
        A graphed step captures its graphs after the first sink pass."""
        cfg, dev = self.cfg, self.device
        if tuple(reference_latent.shape[-3:]) != self._latent_shape():
            raise ValueError(f"reference latent has shape {tuple(reference_latent.shape)}, expected {self._latent_shape()}")
        ref = reference_latent.to(dev).reshape(1, 1, *self._latent_shape()).expand(1, cfg.sink_frames, -1, -1, -1)
        audio = torch.zeros(1, cfg.sink_frames, cfg.n_audio_tokens, cfg.audio_dim, device=dev)
        positions = torch.cat([frame_positions(t, cfg.grid, cfg.n_audio_tokens, dev) for t in range(cfg.sink_frames)])
        # The sampler's levels are fixed and the weights too within a session: their adaLN once.
        self._levels = LevelModulations(self.model)
        self.cache.reset()
        self.cache.begin_sink()
        self.model(ref, torch.zeros(1, cfg.sink_frames, device=dev), audio, RingSelfAttention(self.cache, positions))
        self._session = True
        if self.graphed and not self.graphs:
            self.capture()
        if self.full_window is not None:
            self.full_window.warm()

    @torch.inference_mode()
    def step(self, audio_tokens: torch.Tensor, seed: int) -> torch.Tensor:
        """Generate the next latent frame (C, h, w), float32, from audio tokens (n_audio_tokens, audio_dim)."""
        self.check_step(audio_tokens)
        _, t = self.cache.begin_frame()
        self.set_inputs(audio_tokens, seeded_noise(self.noise.shape, seed), t)
        latent = self.run()[0, 0].clone()
        self.cache.end_frame()
        return latent

    def check_step(self, audio_tokens: torch.Tensor) -> None:
        """Raise if ``step(audio_tokens, ...)`` cannot run now (no session, or tokens of the wrong shape)."""
        cfg = self.cfg
        if not self._session:
            raise RuntimeError("step() before reset_session(): the sink frame is not written")
        if tuple(audio_tokens.shape) != (cfg.n_audio_tokens, cfg.audio_dim):
            raise ValueError(f"audio tokens have shape {tuple(audio_tokens.shape)}, expected {(cfg.n_audio_tokens, cfg.audio_dim)}")

    def rollback(self, k: int) -> int:
        """Forget the last ``k`` generated frames; returns how many context frames could not be restored
        (0 when ``k`` <= cfg.rollback_frames: then regenerating equals never having generated them)."""
        return self.cache.rollback(k)

    # -- one run on the current inputs ----------------------------------------------------------------

    @torch.inference_mode()
    def set_inputs(self, audio_tokens: torch.Tensor, noise: torch.Tensor, time_position: int) -> None:
        """Load one step's inputs into the step's buffers (the ring pointer comes from the cache, after
        its ``begin_frame``) and pick the attention backend: the full window's once the whole window is valid."""
        cache = self.cache
        self.audio.copy_(audio_tokens.reshape(self.audio.shape))
        self.noise.copy_(noise.reshape(self.noise.shape))
        self.positions[:, 0].fill_(time_position)
        self.slot.fill_(cache.write_start)
        if self.body is None:
            return
        full = self.full_window is not None and len(window_frames_held(cache, self.cfg.window_frames)) == self.cfg.window_frames
        self.attention = self.full_window if full else self.ring
        self.attention.prepare()

    @torch.inference_mode()
    def run(self, graphed: bool | None = None) -> torch.Tensor:
        """One step on the current inputs; returns the latent buffer (1, 1, C, h, w). ``graphed``:
        replay the captured graph (default: the step's mode) or run the body eagerly."""
        if self.graphed if graphed is None else graphed:
            if not self.graphs:
                raise RuntimeError("a graphed run before capture()")
            self.graphs[self.attention].replay()
        else:
            self._body()
        return self.latent

    @one_capture_at_a_time
    @torch.inference_mode()
    def capture(self, warmup: int = 2) -> None:
        """Record the fused body as CUDA graphs, one per attention backend (model/graphs.py; the warm-up
        runs also create a TP group's NCCL communicator before capture).

        Every rank of a TP group captures at the same call (``reset_session``), so the collectives
        recorded match. The warm-up runs write ring slots at the current pointer; those slots and
        the saturation count are restored afterwards, so capturing mid-session changes nothing."""
        cache, span = self.cache, slice(int(self.slot), int(self.slot) + self.cfg.tokens_per_step)
        saved = (cache.k[:, :, span].clone(), cache.v[:, :, span].clone(), cache.saturated.clone())
        current = self.attention
        self.capture_stream = torch.cuda.Stream()  # kept (model/graphs.py says why)
        for backend in (self.ring, self.full_window):
            if backend is not None:
                self.attention = backend
                self.graphs[backend], _ = capture_graph(self._body, self.capture_stream, warmup)
        self.attention = current
        cache.k[:, :, span], cache.v[:, :, span] = saved[:2]
        cache.saturated.copy_(saved[2])

    def _body(self) -> None:
        if self.body is not None:
            self.body()
        else:
            module_body(self.model, self._levels, self.inputs, RingSelfAttention(self.cache, self.positions))
