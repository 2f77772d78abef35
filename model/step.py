"""The diffusion step of one TP rank: 4 sampler passes of the DiT over the KV ring, the last pass's K/V kept.

    step = DiffusionStep(model, cache, tp_group, fused=True, graphed=True)
    step.reset_session(reference_latent)   # the sink pass (eager), then the graphs are captured once
    latent = step.step(audio_tokens, seed) # one chunk
    step.rollback(k)                       # turn-start rollback: forget the last k frames

Every rank of every deployment runs this object: ``model/generator.py`` builds it for one rank,
``stages/diffusion/tp_group.py`` on every rank of a TP group, ``charstream bench gpu`` times it. Two bodies
compute the velocity of one pass; everything else (inputs, sampler, cache bookkeeping, rollback,
position reset, the TP group) is shared:

- the module body: ``DiT.forward`` over the ring (``RingSelfAttention``) in the model's dtype -- the
  CPU serving path; under TP the block's all-reduce is ``w_out``'s forward hook (model/tp.py);
- the fused body (``fused=True``): FP8 GEMMs and fused kernels through the kernels' entry points,
  per block-pass

    adaln_quant     residual x += gate * out (previous block), LayerNorm, adaLN, FP8 rows   1 launch
    w_in            FP8 GEMM -> fused [q | k | v | cross-q | mlp-up]                       1 launch
    ring_write_prep QK-norms, RoPE(q) in place, RoPE(k) + FP8 + ring write of K and V (and,
                    gathered, their dequantized copy into the layer's attention window),
                    cross-q norm in place, saturation count; RoPE from one table per step 1 launch
    attention       q over sink + valid ring: in place over the FP8 ring while the window
                    fills, written over the spent v columns, then cuDNN SDPA over the
                    layer's bf16 window, which the ring write above keeps current
                    (``gathered``, faster on an H200), into cuDNN's own buffer            2 / 1 launches
                    (``fp8_window``: the window holds the ring's codes, the prep writes q's
                    e4m3 codes, cuDNN's FP8 SDPA writes e4m3 output whose per-head scales
                    quantize_rows applies as it reads it; with the window's keys split
                    (``window_splits`` > 1, where cuDNN's query tiles would leave SMs idle)
                    it writes each partition's output and statistics, and merge_partials
                    writes their merge over the spent v columns                          +1 launch)
    cross attention cross-q over the step's audio K/V, written over the cross-q columns    1 launch
    quantize_rows   GELU on the mlp columns + FP8 rows of [attn | cross | mlp], the attn
                    columns read from cuDNN's buffer when gathered (no copy into v)        1 launch
    w_out           FP8 GEMM, then the block's one all-reduce under TP                     1-2 launches

  so [attn | cross | mlp] is the fused buffer's tail and nothing is concatenated. Once per step, before
  the passes, every block's audio K/V come from one FP8 GEMM (``FusedCrossContext``). On CUDA it runs
  eagerly or (``graphed``) as one CUDA graph per attention mode, the all-reduces inside the graph
  (NCCL collectives are capturable); on CPU it runs eagerly on the kernels' PyTorch references,
  which is how the CPU tests check its collectives.

Everything that moves between steps -- ring write pointer, time position, ring validity, window
order, noise, audio -- lives in device tensors the graph reads, and the cache's storage is never
reallocated, so one capture serves a whole session: rollbacks are host bookkeeping, and the
position reset's delta rotation runs in place, outside the graph, in ``KVCache.begin_frame``. The
sink pass (``sink_frames`` frames, a shape no other step has) always runs eagerly through
``DiT.forward``.

Many sessions of one model in one forward: ``BatchedStep`` (the end of this file). Each session is a
``DiffusionStep`` on a lane of one ``KVPool``; a batch runs the module body (``module_body``, the same
function the single step's module body calls) once over the lanes, through ``LaneSelfAttention``, with
every per-session value in device tensors, so one CUDA graph per batch size serves.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from charstream.kernels.adaln_quant import adaln_quant
from charstream.kernels.attention_merge import merge_partials
from charstream.kernels.cross_attention import cross_attention
from charstream.kernels.fp8 import FP8_DTYPE, FP8_MAX
from charstream.kernels.fp8_window_attention import Fp8WindowAttention, choose_window_splits
from charstream.kernels.quantize_rows import quantize_rows
from charstream.kernels.ring_attention import (
    gather_window,
    ring_attention,
    ring_attention_triton,
    window_attention,
)
from charstream.kernels.ring_write import ring_write_prep_reference, ring_write_prep_triton, rope_table
from charstream.kernels.rope import rope_freqs, rotate_complex
from charstream.model.cache import KVCache, KVPool
from charstream.model.capture import CAPTURE_MODE, one_capture_at_a_time
from charstream.model.config import ModelConfig
from charstream.model.dit import DiT, Modulation, SelfAttention
from charstream.model.fp8_linear import Fp8Linear, quantize_weight
from charstream.model.graph_memsets import hoist_counter_memsets
from charstream.model.rope import frame_positions
from charstream.model.sampler import sample, seeded_noise

# The ring attention's launch options (block shapes, pipelining, FP8 or fp16 products): none, so the
# kernel's own defaults serve -- the H200 sweep's best (0.153 ms per TP=3 call against 0.170 with the
# 64-row blocks this used to pin: docs/PERF.md, issue 14, run 4).
ATTENTION_OPTIONS: dict = {}
# The gathered (cuDNN) attention once the window is full: faster on the H200 in run 3 (132.5 vs
# 149.9 ms per TP=3 step) with its GPU tests passing (docs/gpu-runs/2026-11-29-run3-*).
GATHERED_BY_DEFAULT = True
# The libraries' 4-byte counter memsets (cuBLASLt's FP8 GEMMs, cuDNN's SDPA) run beside the kernel before
# them instead of after it (model/graph_memsets.py)
HOIST_MEMSETS_BY_DEFAULT = True
# The FP8 window attention's output scale (its codes = output in V's code units x this): the output is a
# convex combination of V's codes (<= 448), and e4m3's rounding of the probabilities may lift it a few
# percent past that, so half of e4m3's range keeps it in range (e4m3fn has no infinity: past 448 is NaN).
FP8_OUTPUT_SCALE = 0.5


class RingSelfAttention:
    """The module body's self-attention of one frame (or the sink) through the ring: write K/V, attend in place."""

    def __init__(self, cache: KVCache, positions: torch.Tensor) -> None:
        self.cache, self.positions = cache, positions
        # RoPE of the queries and keys of every layer, built once per step (the ring write reads it
        # too); one complex multiply rotates a tensor.
        self.rotation = rope_table(positions, cache.freqs)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        shape = q.shape  # (1, F, T, H, D)
        q, k, v = (t.reshape(-1, *shape[-2:]) for t in (q, k, v))
        self.cache.write(layer, k, v, self.positions, self.rotation)
        return self.cache.attend(layer, rotate_complex(q, self.rotation).to(q.dtype)).reshape(shape)


class LaneSelfAttention:
    """The module body's self-attention of one frame in each session of a batch, lanes of one ``KVPool``:
    lanes, write pointers, positions and validity are read from device tensors, so a CUDA graph replays it."""

    def __init__(self, pool: KVPool, inputs: StepInputs) -> None:
        self.pool, self.lanes, self.slot = pool, inputs.lanes, inputs.slot
        b, t = inputs.positions.shape[:2]
        # per step, as RingSelfAttention: the RoPE tables of every frame and each lane's attention bias
        self.rotation = rope_table(inputs.positions.flatten(0, 1), pool.freqs).unflatten(0, (b, t))
        self.bias = pool.slot_bias(inputs.lanes)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        shape = q.shape  # (B, 1, T, H, D)
        q, k, v = (t.flatten(1, 2) for t in (q, k, v))
        self.pool.write(layer, self.lanes, self.slot, k, v, self.rotation)
        q = rotate_complex(q, self.rotation).to(q.dtype)
        return self.pool.attend(layer, self.lanes, q, self.bias).reshape(shape)


class StepInputs:
    """One run's inputs in device buffers (a CUDA graph reads them) and its output, for a batch of
    ``batch`` frames: per row the noise, the audio tokens, the tokens' positions (B, T, 3), the ring
    write pointer and the ``KVPool`` lane of one session's frame."""

    def __init__(self, cfg: ModelConfig, batch: int, device: torch.device) -> None:
        self.noise = torch.zeros(batch, 1, cfg.latent_channels, cfg.latent_height, cfg.latent_width, device=device)
        self.audio = torch.zeros(batch, 1, cfg.n_audio_tokens, cfg.audio_dim, device=device)
        self.positions = frame_positions(0, cfg.grid, cfg.n_audio_tokens, device)[None].repeat(batch, 1, 1)
        self.slot = torch.zeros(batch, dtype=torch.int64, device=device)
        self.lanes = torch.zeros(batch, dtype=torch.int64, device=device)
        self.latent = torch.zeros_like(self.noise)


class LevelModulations:
    """The module body's adaLN of the sampler's fixed levels, computed once: the weights are fixed
    while it serves."""

    def __init__(self, model: DiT) -> None:
        dev = model.head.weight.device
        self.sigma = {s: torch.full((1, 1), s, device=dev) for s in model.cfg.noise_levels}
        self.modulation: dict[float, Modulation] = {s: model.modulation(self.sigma[s]) for s in model.cfg.noise_levels}


def module_body(model: DiT, levels: LevelModulations, inputs: StepInputs, attn: SelfAttention) -> None:
    """The module body: the sampler's passes of ``DiT.forward`` over ``attn``'s ring(s), one batch of
    ``inputs`` (one session's frame or one per lane), into ``inputs.latent``. Modulations broadcast
    over the batch."""
    cross_kv = model.cross_context(inputs.audio)

    def velocity(x: torch.Tensor, sigma: float) -> torch.Tensor:
        return model(x, levels.sigma[sigma], inputs.audio, attn, cross_kv, levels.modulation[sigma])

    inputs.latent.copy_(sample(velocity, inputs.noise, model.cfg.noise_levels))


class FusedCrossContext:
    """Every block's cross-attention K/V of one step, from the audio context (A, dim), in one FP8 GEMM
    over all blocks' ``w_cross_kv`` and one RMS norm of all their keys (``cross_k_norm``), as the module
    body's ``ParallelBlock.cross_context`` computes them block by block: one block's K/V is a (heads, A,
    head_dim) view of the one output, no copy. Block by block, each is a bf16 GEMM of 9 rows over its whole
    weight, the norm's passes and two copies: a few launches a block (docs/PERF.md, issue 14)."""

    def __init__(self, model: DiT) -> None:
        blocks = model.blocks
        weights, scales = zip(*(quantize_weight(b.w_cross_kv.weight) for b in blocks), strict=True)
        self.kv = Fp8Linear(torch.cat(weights), torch.cat(scales))  # rows: block, [k | v], head, head_dim
        self.k_norm = torch.stack([b.cross_k_norm.weight.detach() for b in blocks])[:, None]  # (blocks, 1, head_dim)
        self.eps = blocks[0].cross_k_norm.eps
        self.shape = (len(blocks), 2, blocks[0].n_heads, blocks[0].head_dim)

    def __call__(self, context: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """context (A, dim) -> per block (k, v), each (heads, A, head_dim) with the strides of the one output."""
        kv = self.kv(context).unflatten(-1, self.shape)  # (A, blocks, 2, heads, head_dim)
        k = kv[:, :, 0]
        k.copy_(F.rms_norm(k.float(), k.shape[-1:], eps=self.eps).to(k.dtype) * self.k_norm)
        return [(kv[:, i, 0].transpose(0, 1), kv[:, i, 1].transpose(0, 1)) for i in range(self.shape[0])]


class DiffusionStep:
    def __init__(
        self,
        model: DiT,
        cache: KVCache,
        tp_group: dist.ProcessGroup | None = None,
        fused: bool = False,
        graphed: bool = False,
        attention_options: dict | None = None,
        prefer_gathered: bool = GATHERED_BY_DEFAULT,
        fp8_window: bool = False,
        hoist_memsets: bool = HOIST_MEMSETS_BY_DEFAULT,
        window_splits: int | None = None,
    ) -> None:
        cfg = model.cfg
        dev = cache.k.device
        if graphed and not (fused and dev.type == "cuda"):
            raise ValueError("a graphed step needs the fused body on a CUDA device")
        self.model, self.cache, self.cfg, self.tp_group = model, cache, cfg, tp_group
        self.fused, self.graphed = fused, graphed
        self.device = dev
        dtype = model.head.weight.dtype
        t = cfg.tokens_per_step
        # The step's inputs (written before each run; the graph reads them) and its output: a batch of one.
        self.inputs = StepInputs(cfg, 1, dev)
        self.noise, self.audio, self.latent = self.inputs.noise, self.inputs.audio, self.inputs.latent
        self.positions, self.slot = self.inputs.positions[0], self.inputs.slot[0]
        self.graphs: dict[bool, torch.cuda.CUDAGraph] = {}
        # the libraries' counter memsets moved off the graphs' critical path (model/graph_memsets.py),
        # and how many moved per graph
        self.hoist_memsets, self.memsets_moved = hoist_memsets, {}
        self.gathered = False  # the attention mode of the next run (fused body), set by set_inputs
        self._session = False
        self.fp8_window = fp8_window
        if fp8_window and not (fused and prefer_gathered and dev.type == "cuda" and cache.fp8):
            raise ValueError("fp8_window needs the fused step's gathered attention on CUDA over an FP8 cache")
        if window_splits is not None and not fp8_window:
            raise ValueError("window_splits splits the FP8 window's keys: it needs fp8_window")
        if not fused:
            return
        block = model.blocks[0]
        self.n_heads, self.head_dim = block.n_heads, block.head_dim
        self.hd = self.n_heads * self.head_dim
        self.attention_options = dict(ATTENTION_OPTIONS if attention_options is None else attention_options)
        self.w_in = [Fp8Linear.from_weight(b.w_in.weight) for b in model.blocks]
        self.w_out = [Fp8Linear.from_weight(b.w_out.weight) for b in model.blocks]
        self.cross_context = FusedCrossContext(model)
        self.norms = [(b.q_norm.weight, b.k_norm.weight, b.cross_q_norm.weight) for b in model.blocks]
        with torch.inference_mode():  # per level: every block's (shift, scale, gate), the final (shift, scale)
            self.mods, self.final_mods = model.level_modulations(torch.tensor(cfg.noise_levels, device=dev))
        self.level_index = {sigma: i for i, sigma in enumerate(cfg.noise_levels)}
        self.x = torch.zeros(t, cfg.dim, dtype=dtype, device=dev)  # the residual stream
        # The gathered attention (CUDA: cuDNN) once the window is full reads every layer's window
        # dequantized into contiguous bf16: the sink, then frame f at window position f % window_frames.
        # Each pass's ring write also writes its frame there, so the window is gathered from the ring
        # (one launch per layer) only when the cache's history was rewritten since it last mirrored it.
        self.prefer_gathered = prefer_gathered and dev.type == "cuda"
        self.frame_order = torch.zeros(cfg.window_frames, dtype=torch.int32, device=dev)
        self.window_slot = torch.zeros((), dtype=torch.int64, device=dev)
        self._window_mirrors: tuple[int, int] | None = None  # (cache.version, next frame) it holds up to
        win = (cfg.n_blocks, self.n_heads, cache.sink_slots + cfg.window_frames * t, self.head_dim)
        # fp8_window: the window holds the ring's FP8 codes and cuDNN's FP8 SDPA reads them (half the
        # window's bytes; its queries, probabilities and output in e4m3 too: kernels/fp8_window_attention.py)
        win_dtype = FP8_DTYPE if self.fp8_window else dtype
        self.window = tuple(torch.empty(win, dtype=win_dtype, device=dev) for _ in range(2)) if self.prefer_gathered else None
        if self.fp8_window:
            self.q8 = torch.empty(t, self.n_heads, self.head_dim, dtype=FP8_DTYPE, device=dev)
            # the window's key partitions (kernels/fp8_window_attention.py): with more than one, cuDNN writes
            # each partition's output and statistics and merge_partials writes their merge over spent v
            if window_splits is None:
                sms = torch.cuda.get_device_properties(dev).multi_processor_count
                window_splits = choose_window_splits(self.n_heads, t, win[2], sms)
            parts = (window_splits,) if window_splits > 1 else ()
            self.attn8 = torch.empty(*parts, *self.q8.shape, dtype=FP8_DTYPE, device=dev)
            self.attn_lse = torch.empty(window_splits, self.n_heads, t, device=dev) if window_splits > 1 else None
            self.fp8_attention = Fp8WindowAttention(self.n_heads, t, win[2], self.head_dim, self.q8.stride(),
                                                    1.0 / math.sqrt(self.head_dim), dev, splits=window_splits)
            self.unit = torch.ones(1, device=dev)  # K's and V's descales: their scales fold into q's codes and the rows' read
            # per layer: q's descale and its codes' multipliers per head, the output's scales per head
            # (set from the cache's scales whenever the window is gathered: a new session's sink sets them)
            self.q_descale = torch.ones(cfg.n_blocks, 1, device=dev)
            self.q_mult = torch.ones(cfg.n_blocks, self.n_heads, device=dev)
            self.out_scale = torch.ones(cfg.n_blocks, self.n_heads, device=dev)
            self.scale_o = torch.full((1,), FP8_OUTPUT_SCALE, device=dev)
            # |RoPE(q_norm(q))| <= sqrt(head_dim) x max |q_norm weight| per element (an RMS-normalised row
            # has squared norm head_dim; RoPE keeps each pair's norm), plus bf16's rounding
            self.q_bound = torch.stack([b.q_norm.weight.detach().float().abs().amax() for b in model.blocks]) * (
                math.sqrt(self.head_dim) * (1 + 2.0**-7))

    @property
    def window_splits(self) -> int:
        """The full window's key partitions: the FP8 window's (``Fp8WindowAttention.splits``), else 1."""
        return self.fp8_attention.splits if self.fp8_window else 1

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
        if self.fused and self.prefer_gathered and self._window_mirrors is None:
            # The window gather's kernel compiles at its first call, which is otherwise the step that first
            # finds the window full: that step stalled ~0.9 s on the H200 (a held frame in every session).
            self._gather_window([0] * self.cfg.window_frames)  # what it writes is rebuilt at that step

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
        its ``begin_frame``) and pick the attention mode: gathered once the whole window is valid."""
        cache = self.cache
        self.audio.copy_(audio_tokens.reshape(self.audio.shape))
        self.noise.copy_(noise.reshape(self.noise.shape))
        self.positions[:, 0].fill_(time_position)
        self.slot.fill_(cache.write_start)
        if not self.fused:
            return
        frame, n_window = cache.next_frame, self.cfg.window_frames
        oldest = frame - n_window + 1
        held = [f for f in cache.slot_frame if f is not None and oldest <= f <= frame]
        self.gathered = self.prefer_gathered and len(held) == n_window
        if not self.gathered:
            return
        self.window_slot.fill_(cache.sink_slots + frame % n_window * cache.tokens_per_frame)
        if self._window_mirrors != (cache.version, frame):
            self._gather_window(sorted(held, key=lambda f: f % n_window))
        self._window_mirrors = (cache.version, frame + 1)  # once this run has written the frame

    def _gather_window(self, frames: list[int]) -> None:
        """Rebuild every layer's window from the ring: the sink, then ``frames`` (by window position)."""
        cache = self.cache
        self.frame_order.copy_(torch.tensor([f % cache.ring_frames for f in frames], dtype=torch.int32))
        for layer in range(self.cfg.n_blocks):
            gather_window(cache.k[layer], cache.v[layer], cache.k_scale[layer], cache.v_scale[layer], self.frame_order,
                          cache.sink_slots, cache.tokens_per_frame, (self.window[0][layer], self.window[1][layer]))
        if self.fp8_window:  # K's scales fold into q's codes (under e4m3's largest), V's apply to the output
            self.q_descale.copy_(self.q_bound[:, None] * cache.k_scale.amax(dim=1, keepdim=True) / FP8_MAX)
            self.q_mult.copy_(cache.k_scale / self.q_descale)
            self.out_scale.copy_(cache.v_scale / FP8_OUTPUT_SCALE)

    @torch.inference_mode()
    def run(self, graphed: bool | None = None) -> torch.Tensor:
        """One step on the current inputs; returns the latent buffer (1, 1, C, h, w). ``graphed``:
        replay the captured graph (default: the step's mode) or run the body eagerly."""
        if self.graphed if graphed is None else graphed:
            if not self.graphs:
                raise RuntimeError("a graphed run before capture()")
            self.graphs[self.gathered].replay()
        else:
            self._body()
        return self.latent

    @one_capture_at_a_time
    @torch.inference_mode()
    def capture(self, warmup: int = 2) -> None:
        """Record the fused body as CUDA graphs, one per attention mode (after warm-up runs on a side
        stream, as PyTorch asks; they also create a TP group's NCCL communicator before capture).

        Every rank of a TP group captures at the same call (``reset_session``), so the collectives
        recorded match. The warm-up runs write ring slots at the current pointer; those slots and
        the saturation count are restored afterwards, so capturing mid-session changes nothing.
        ``hoist_memsets``: each graph's library counter memsets are moved beside the kernel before them
        before it is instantiated (model/graph_memsets.py)."""
        cache, span = self.cache, slice(int(self.slot), int(self.slot) + self.cfg.tokens_per_step)
        saved = (cache.k[:, :, span].clone(), cache.v[:, :, span].clone(), cache.saturated.clone())
        mode = self.gathered
        # Captured on a stream of its own, kept: cuBLAS keys its workspace by (handle, stream), and graphs
        # captured on torch.cuda.graph's one shared default stream share that workspace -- replayed
        # concurrently (the decoder's graph on a second stream), their GEMMs race on it.
        self.capture_stream = torch.cuda.Stream()
        for gathered in (False, True) if self.prefer_gathered else (False,):
            self.gathered = gathered
            self.capture_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.capture_stream):
                for _ in range(warmup):
                    self._body()
            torch.cuda.current_stream().wait_stream(self.capture_stream)
            graph = torch.cuda.CUDAGraph(keep_graph=self.hoist_memsets)
            with torch.cuda.graph(graph, stream=self.capture_stream, capture_error_mode=CAPTURE_MODE):
                self._body()
            if self.hoist_memsets:
                self.memsets_moved[gathered] = hoist_counter_memsets(graph)
                graph.instantiate()
            self.graphs[gathered] = graph
        self.gathered = mode
        cache.k[:, :, span], cache.v[:, :, span] = saved[:2]
        cache.saturated.copy_(saved[2])

    # -- the bodies ---------------------------------------------------------------------------------

    def _body(self) -> None:
        if self.fused:
            self.latent.copy_(sample(self._fused_velocity(), self.noise, self.cfg.noise_levels))
        else:
            module_body(self.model, self._levels, self.inputs, RingSelfAttention(self.cache, self.positions))

    def _fused_velocity(self):
        m = self.model
        audio = self.audio.to(self.x.dtype)
        audio_x = m.audio_embed(audio)[0, 0]
        cross_kv = self.cross_context(m.audio_context(audio)[0, 0])  # per block (heads, A, head_dim): the cross "cache"
        rotation = rope_table(self.positions, self.cache.freqs)  # every layer's and pass's RoPE, once

        def velocity(latent: torch.Tensor, sigma: float) -> torch.Tensor:
            return self._fused_pass(latent, self.level_index[sigma], audio_x, cross_kv, rotation)

        return velocity

    def _fused_pass(self, latent: torch.Tensor, level: int, audio_x: torch.Tensor, cross_kv: list,
                    rotation: torch.Tensor) -> torch.Tensor:
        m, cfg = self.model, self.cfg
        video = m.patch_embed(m.patchify(latent.to(self.x.dtype)))[0, 0]
        torch.cat([video, audio_x], dim=0, out=self.x)
        out = gate = None
        for layer in range(cfg.n_blocks):
            out = self._fused_block(layer, level, out, gate, cross_kv[layer], rotation)
            gate = self.mods[level, layer, 2]
        x = self.x + gate * out
        shift, scale = self.final_mods[level]
        h = m.final_norm(x[: cfg.video_tokens]) * (1 + scale) + shift
        return m.unpatchify(m.head(h)[None, None])

    def _fused_block(self, layer: int, level: int, out: torch.Tensor | None, gate: torch.Tensor | None,
                     cross: tuple[torch.Tensor, torch.Tensor], rotation: torch.Tensor) -> torch.Tensor:
        cache, hd, shape = self.cache, self.hd, (self.n_heads, self.head_dim)
        shift, scale, _ = self.mods[level, layer]
        hq = adaln_quant(self.x, shift, scale, out, gate)
        fused = self.w_in[layer].forward_quantized(*hq, out_dtype=self.x.dtype)
        q, k, v, cq = (fused[:, i * hd : (i + 1) * hd].unflatten(-1, shape) for i in range(4))
        layer_cache = (cache.k[layer], cache.v[layer], cache.k_scale[layer], cache.v_scale[layer])
        window = (self.window[0][layer], self.window[1][layer], self.window_slot) if self.gathered else None
        prep = ring_write_prep_triton if q.is_cuda else ring_write_prep_reference
        fp8 = self.gathered and self.fp8_window
        q8 = (self.q8, self.q_mult[layer]) if fp8 else None
        prep(q, k, v, cq, *layer_cache, self.slot, self.positions, cache.freqs, self.norms[layer], cache.saturated,
             rotation=rotation, window=window, q8=q8)
        attn = attn_scale = None  # the attention output when it is not in the v columns: cuDNN writes a buffer of its own
        if fp8:
            self.fp8_attention(self.q8, *window[:2], self.q_descale[layer], self.unit, self.unit, self.scale_o,
                               self.attn8, self.attn_lse)
            if self.attn_lse is not None:
                merge_partials(self.attn8, self.attn_lse, self.out_scale[layer], v)
            else:
                attn, attn_scale = self.attn8.flatten(1), self.out_scale[layer]
        elif self.gathered:
            attn = window_attention(q, *window[:2]).flatten(1)  # read there by quantize_rows, not copied over v
        elif q.is_cuda:
            ring_attention_triton(q, *layer_cache, cache.ring_valid, cache.sink_slots, cache.tokens_per_frame, out=v,
                                  **self.attention_options)
        else:
            v.copy_(ring_attention(q, *layer_cache, cache.ring_valid, cache.sink_slots, cache.tokens_per_frame))
        ck, cv = cross  # the step's audio K/V of this block, each (heads, audio tokens, head_dim)
        cross_attention(cq, ck, cv, cq)
        oq = quantize_rows(fused[:, 2 * hd :], act_from=2 * hd, prefix=attn, prefix_scale=attn_scale)
        result = self.w_out[layer].forward_quantized(*oq, out_dtype=self.x.dtype)
        if self.tp_group is not None:
            dist.all_reduce(result, group=self.tp_group)  # the block's one collective
        return result


BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # batch sizes with a CUDA graph each (and max_sessions)


class BatchedStep:
    """One forward for the due steps of up to ``max_sessions`` sessions of one model (TP 1).

        batch = BatchedStep(model, max_sessions=32, kv_dtype=FP8_DTYPE, graphed=True)
        step = batch.open()                      # a session: a DiffusionStep (module body) on a free lane
        step.reset_session(reference_latent)     # its sink pass, alone, eager
        latents = batch.step([step, ...], [audio_tokens, ...], [seed, ...])   # (n, C, h, w), row i: steps[i]
        step.rollback(k)                         # between batches, as alone
        batch.close(step)                        # the lane is free for the next session

    Each session keeps everything of its own: its ring (a lane of one ``KVPool``) with its FP8 scales,
    validity and write pointer, its frame count and time position (its position resets happen in its
    ``begin_frame``), its rollbacks and its seeds; a batch gathers them into ``StepInputs`` and runs
    ``module_body`` once over the lanes (``LaneSelfAttention``). Alone, the same session is the
    same DiffusionStep stepping by itself. A batch is padded to the next bucket size with rows that
    write and read a scratch lane no session owns; ``graphed`` (CUDA) captures one graph per bucket at
    construction, so a batch is one replay."""

    def __init__(self, model: DiT, max_sessions: int, kv_dtype: torch.dtype, graphed: bool = False,
                 buckets: tuple[int, ...] = BUCKETS) -> None:
        cfg, dev = model.cfg, model.head.weight.device
        if graphed and dev.type != "cuda":
            raise ValueError("a graphed batched step needs a CUDA device")
        if model.tp_world != 1:
            raise ValueError(f"batched sessions run at TP 1, not {model.tp_world}")
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        self.model, self.cfg, self.device, self.graphed = model, cfg, dev, graphed
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
        if graphed:
            self.capture()

    def open(self) -> DiffusionStep:
        """A new session on the lowest free lane (call its ``reset_session`` before its first step)."""
        lane = next((i for i in range(self.max_sessions) if i not in self.sessions), None)
        if lane is None:
            raise RuntimeError(f"the batched step holds {self.max_sessions} sessions already")
        cache = KVCache(self.cfg, self.cfg.n_heads, self.pool.k.dtype, self.device, self.freqs, pool=self.pool, lane=lane)
        self.sessions[lane] = DiffusionStep(self.model, cache)
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
        """One CUDA graph per bucket, on a stream of its own (see ``DiffusionStep.capture``), sharing one
        memory pool (they never replay concurrently); warm-up and capture rows point at the scratch lane."""
        self.capture_stream = torch.cuda.Stream()
        memory = torch.cuda.graph_pool_handle()
        for bucket in self.buckets:
            inputs = self.inputs[bucket]
            inputs.lanes.fill_(self.scratch)
            inputs.slot.fill_(self.pool.sink_slots)
            self.capture_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.capture_stream):
                for _ in range(warmup):
                    self._body(inputs)
            torch.cuda.current_stream().wait_stream(self.capture_stream)
            self.graphs[bucket] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graphs[bucket], pool=memory, stream=self.capture_stream,
                                  capture_error_mode=CAPTURE_MODE):
                self._body(inputs)

    def _body(self, inputs: StepInputs) -> None:
        module_body(self.model, self.levels, inputs, LaneSelfAttention(self.pool, inputs))
