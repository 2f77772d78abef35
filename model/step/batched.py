"""Many sessions of one model in one forward (TP 1).

    batch = BatchedStep(model, max_sessions=32, kv_dtype=FP8_DTYPE, options=StepOptions())
    step = batch.open()                      # a session: a DiffusionStep (module body) on a free lane
    step.reset_session(reference_latent)     # its sink pass, alone, eager
    latents = batch.step([step, ...], [audio_tokens, ...], [seed, ...])   # (n, C, h, w), row i: steps[i]
    step.rollback(k)                         # between batches, as alone
    batch.close(step)                        # the lane is free for the next session

Each session keeps everything of its own: its ring (a lane of one ``KVPool``) with its FP8 scales,
validity and write pointer, its frame count and time position (its position resets happen in its
``begin_frame``), its rollbacks and its seeds; a batch gathers them into ``StepInputs`` and runs
``module_body`` once over the lanes (``LaneSelfAttention``). Alone, the same session is the same
DiffusionStep stepping by itself. A batch is padded to the next bucket size with rows that write and
read a scratch lane no session owns; graphed (``options.graphed`` on CUDA) captures one graph per
bucket at construction, so a batch is one replay.
"""

from __future__ import annotations

import torch

from charstream.kernels.rope import rope_freqs
from charstream.model.cache import KVCache, KVPool
from charstream.model.dit import DiT
from charstream.model.graphs import capture_graph, one_capture_at_a_time
from charstream.model.sampler import seeded_noise
from charstream.model.step.inputs import StepInputs
from charstream.model.step.module import LaneSelfAttention, LevelModulations, module_body
from charstream.model.step.options import DEFAULTS, StepOptions
from charstream.model.step.step import DiffusionStep

BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # batch sizes with a CUDA graph each (and max_sessions)
MODULE_BODY = StepOptions(fused=False)  # each session's own step: its sink pass, alone


class BatchedStep:
    def __init__(self, model: DiT, max_sessions: int, kv_dtype: torch.dtype, options: StepOptions = DEFAULTS,
                 buckets: tuple[int, ...] = BUCKETS) -> None:
        """``options``: the batch runs the module body; of the options, ``graphed`` applies (on CUDA)."""
        cfg, dev = model.cfg, model.head.weight.device
        if model.tp_world != 1:
            raise ValueError(f"batched sessions run at TP 1, not {model.tp_world}")
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        if options.fused or options.attention == "fp8_window":  # the body attends per lane over the ring
            raise ValueError("a batched step runs the module body: step.fused and step.attention 'fp8_window' "
                             "are a single session's")
        self.model, self.cfg, self.device = model, cfg, dev
        self.graphed = options.graphed and dev.type == "cuda"
        self.max_sessions = max_sessions
        self.freqs = rope_freqs(cfg.head_dim, dev)
        self.pool = KVPool(cfg, cfg.n_heads, kv_dtype, dev, self.freqs, lanes=max_sessions + 1)
        self.scratch = max_sessions  # the padding rows' lane
        self.sessions: dict[int, DiffusionStep] = {}  # lane -> its open session
        self.buckets = sorted({b for b in buckets if b < max_sessions} | {max_sessions})
        with torch.inference_mode():
            self.levels = LevelModulations(model)
        self.inputs = {b: StepInputs(cfg, b, dev) for b in self.buckets}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if self.graphed:
            self.capture()

    def open(self) -> DiffusionStep:
        """A new session on the lowest free lane (call its ``reset_session`` before its first step)."""
        lane = next((i for i in range(self.max_sessions) if i not in self.sessions), None)
        if lane is None:
            raise RuntimeError(f"the batched step holds {self.max_sessions} sessions already")
        cache = KVCache(self.cfg, self.cfg.n_heads, self.pool.k.dtype, self.device, self.freqs, pool=self.pool, lane=lane)
        self.sessions[lane] = DiffusionStep(self.model, cache, options=MODULE_BODY)
        return self.sessions[lane]

    def close(self, step: DiffusionStep) -> None:
        """End ``step``'s session: its lane is free (the next session's ``reset_session`` clears it)."""
        if self.sessions.get(step.cache.lane) is not step:
            raise ValueError("not an open session of this batched step")
        del self.sessions[step.cache.lane]
        step._session = False

    @torch.inference_mode()
    def step(self, steps: list[DiffusionStep], audio_tokens: list[torch.Tensor], seeds: list[int],
             graphed: bool | None = None) -> torch.Tensor:
        """The next latent frame of each session in ``steps`` (distinct open sessions), one forward:
        (n, C, h, w) float32 on the device, row i the frame ``steps[i].step(audio_tokens[i], seeds[i])``
        would generate alone. ``graphed``: replay the bucket's graph (default: the batch's mode) or run eagerly."""
        n, cfg = len(steps), self.cfg
        if not 0 < n <= self.max_sessions or len(audio_tokens) != n or len(seeds) != n:
            raise ValueError(f"a batch of {n} sessions, {len(audio_tokens)} audio and {len(seeds)} seeds "
                             f"(1 to {self.max_sessions} of each)")
        if len({s.cache.lane for s in steps}) != n or any(self.sessions.get(s.cache.lane) is not s for s in steps):
            raise ValueError("a batch takes distinct open sessions of this batched step")
        for s, a in zip(steps, audio_tokens, strict=True):
            s.check_step(a)  # before any session's state moves
        bucket = self.bucket(n)
        pad = bucket - n
        inputs = self.inputs[bucket]
        times = [s.cache.begin_frame()[1] for s in steps]
        frame = (1, cfg.latent_channels, cfg.latent_height, cfg.latent_width)
        noise = [seeded_noise(frame, seed) for seed in seeds] + [torch.zeros(frame)] * pad
        inputs.noise.copy_(torch.stack(noise))
        audio = [a.reshape(1, cfg.n_audio_tokens, cfg.audio_dim) for a in audio_tokens]
        inputs.audio.copy_(torch.stack(audio + [torch.zeros_like(audio[0])] * pad))
        inputs.positions[:, :, 0].copy_(torch.tensor(times + [cfg.sink_frames] * pad)[:, None])
        inputs.slot.copy_(torch.tensor([s.cache.write_start for s in steps] + [self.pool.sink_slots] * pad))
        inputs.lanes.copy_(torch.tensor([s.cache.lane for s in steps] + [self.scratch] * pad))
        if self.graphed if graphed is None else graphed:
            if not self.graphs:
                raise RuntimeError("a graphed run before capture()")
            self.graphs[bucket].replay()
        else:
            self._body(inputs)
        latents = inputs.latent[:n, 0].clone()
        for s in steps:
            s.cache.end_frame()
        return latents

    def bucket(self, n: int) -> int:
        """The batch size (and graph) a batch of ``n`` sessions runs at."""
        return next(b for b in self.buckets if b >= n)

    @one_capture_at_a_time
    @torch.inference_mode()
    def capture(self, warmup: int = 2) -> None:
        """One CUDA graph per bucket (model/graphs.py), sharing one memory pool (they never replay
        concurrently); warm-up and capture rows point at the scratch lane."""
        self.capture_stream = torch.cuda.Stream()
        memory = torch.cuda.graph_pool_handle()
        for bucket in self.buckets:
            inputs = self.inputs[bucket]
            inputs.lanes.fill_(self.scratch)
            inputs.slot.fill_(self.pool.sink_slots)
            self.graphs[bucket], _ = capture_graph(lambda inputs=inputs: self._body(inputs), self.capture_stream,
                                                   warmup, memory)

    def _body(self, inputs: StepInputs) -> None:
        module_body(self.model, self.levels, inputs, LaneSelfAttention(self.pool, inputs))
