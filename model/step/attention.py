"""The fused body's attention backends: one class per way a block-pass attends, behind one interface.

Every backend's ``forward(layer, q, k, v, cq, rotation)`` runs the block's ring-write prep (QK-norms,
RoPE, FP8 and the ring write of this pass's K/V, the cross-q norm: ``RingWrite``, plus whatever the
backend keeps beside the ring) and the self-attention of the new frame's queries. It returns the
output's place for ``quantize_rows``: (None, None) when written over the spent v columns, else the
buffer holding it and, for FP8 codes, their per-head scales. ``prepare()`` is the host's work before a
run through the backend (outside any graph).

- ``RingBackend``: in place over the FP8 ring (the Triton kernel on CUDA, its reference elsewhere),
  over the sink and the valid ring frames: every step while the window fills;
- ``GatheredBackend``: once the window is full, cuDNN's SDPA over the layer's bf16 ``Window``, which
  each pass's prep keeps current (``gathered``, the default: faster on an H200, docs/PERF.md);
- ``Fp8WindowBackend``: once the window is full, cuDNN's FP8 SDPA over a window of the ring's e4m3
  codes, the queries written as e4m3 codes by the prep; with the window's keys split
  (``window_splits`` > 1, where cuDNN's query tiles would leave SMs idle) each partition's output and
  statistics, merged over the spent v columns (``fp8_window``).

The step picks a backend once per run (``DiffusionStep.set_inputs``); a graphed step has one CUDA
graph per backend.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import torch

from charstream.kernels.attention_merge import merge_partials
from charstream.kernels.fp8 import FP8_DTYPE, FP8_MAX
from charstream.kernels.fp8_window_attention import Fp8WindowAttention, choose_window_splits
from charstream.kernels.ring_attention import (
    gather_window,
    ring_attention,
    ring_attention_triton,
    window_attention,
)
from charstream.kernels.ring_write import ring_write_prep_reference, ring_write_prep_triton
from charstream.model.cache import KVCache
from charstream.model.dit import DiT

# The FP8 window attention's output scale (its codes = output in V's code units x this): the output is a
# convex combination of V's codes (<= 448), and e4m3's rounding of the probabilities may lift it a few
# percent past that, so half of e4m3's range keeps it in range (e4m3fn has no infinity: past 448 is NaN).
FP8_OUTPUT_SCALE = 0.5

Output = tuple[torch.Tensor | None, torch.Tensor | None]


class RingWrite:
    """The block-pass's ring-write prep, shared by every backend (one launch on CUDA): q <- RoPE(q_norm(q))
    and cq <- cross_q_norm(cq) in place, k_norm(k) and v into the ring at the step's write pointer;
    ``window``/``q8``: the backend's extras (kernels/ring_write.py)."""

    def __init__(self, model: DiT, cache: KVCache, slot: torch.Tensor, positions: torch.Tensor) -> None:
        self.cache, self.slot, self.positions = cache, slot, positions
        self.norms = [(b.q_norm.weight, b.k_norm.weight, b.cross_q_norm.weight) for b in model.blocks]

    def layer(self, layer: int) -> tuple[torch.Tensor, ...]:
        """The layer's ring (k, v) and scales (k, v), as the kernels take them."""
        c = self.cache
        return c.k[layer], c.v[layer], c.k_scale[layer], c.v_scale[layer]

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cq: torch.Tensor,
                 rotation: torch.Tensor, window: tuple | None = None, q8: tuple | None = None) -> None:
        prep = ring_write_prep_triton if q.is_cuda else ring_write_prep_reference
        prep(q, k, v, cq, *self.layer(layer), self.slot, self.positions, self.cache.freqs, self.norms[layer],
             self.cache.saturated, rotation=rotation, window=window, q8=q8)


def window_frames_held(cache: KVCache, window_frames: int) -> list[int]:
    """The frames of the next step's window that the ring holds (all ``window_frames`` of them: full)."""
    frame = cache.next_frame
    return [f for f in cache.slot_frame if f is not None and frame - window_frames < f <= frame]


class StepAttention(ABC):
    name: str

    def __init__(self, write: RingWrite) -> None:
        self.write, self.cache = write, write.cache

    @abstractmethod
    def prepare(self) -> None:
        """Host work before a run through this backend."""

    @abstractmethod
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cq: torch.Tensor,
                rotation: torch.Tensor) -> Output:
        """This pass's K/V written (and q, cq prepared in place), then q's attention (see the module)."""


class RingBackend(StepAttention):
    name = "ring"

    def prepare(self) -> None:
        """Nothing: the write pointer and the ring's validity are the step's inputs."""

    def forward(self, layer, q, k, v, cq, rotation) -> Output:
        self.write(layer, q, k, v, cq, rotation)
        c, ring = self.cache, self.write.layer(layer)
        if q.is_cuda:
            ring_attention_triton(q, *ring, c.ring_valid, c.sink_slots, c.tokens_per_frame, out=v)
        else:
            v.copy_(ring_attention(q, *ring, c.ring_valid, c.sink_slots, c.tokens_per_frame))
        return None, None


class Window:
    """Every layer's attention window beside the ring, contiguous: the sink, then frame f at window
    position f % window_frames; bf16 values dequantized from the ring, or the ring's FP8 codes. Each
    pass's prep writes its frame there too (at ``slot``), so the window is gathered from the ring (one
    launch per layer) only when the cache's history was rewritten (a rollback, a position reset, a new
    session) since it last mirrored it."""

    def __init__(self, model: DiT, cache: KVCache, dtype: torch.dtype) -> None:
        cfg, dev, block = model.cfg, cache.k.device, model.blocks[0]
        self.cache, self.n_blocks, self.window_frames = cache, cfg.n_blocks, cfg.window_frames
        self.frame_order = torch.zeros(cfg.window_frames, dtype=torch.int32, device=dev)
        self.slot = torch.zeros((), dtype=torch.int64, device=dev)
        self.mirrors: tuple[int, int] | None = None  # (cache.version, next frame) it holds up to
        shape = (cfg.n_blocks, block.n_heads, cache.sink_slots + cfg.window_frames * cfg.tokens_per_step, block.head_dim)
        self.k, self.v = (torch.empty(shape, dtype=dtype, device=dev) for _ in range(2))

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What the prep also writes: the layer's window (k, v) and the slot of this step's frame."""
        return self.k[layer], self.v[layer], self.slot

    def prepare(self) -> bool:
        """Point the prep at this step's frame, and gather the window if the ring's history was rewritten
        since it last mirrored it; returns whether it was gathered."""
        cache, frame, n = self.cache, self.cache.next_frame, self.window_frames
        self.slot.fill_(cache.sink_slots + frame % n * cache.tokens_per_frame)
        gathered = self.mirrors != (cache.version, frame)
        if gathered:
            self.gather(sorted(window_frames_held(cache, n), key=lambda f: f % n))
        self.mirrors = (cache.version, frame + 1)  # once this run has written the frame
        return gathered

    def gather(self, frames: list[int]) -> None:
        """Rebuild every layer's window from the ring: the sink, then ``frames`` (by window position)."""
        cache = self.cache
        self.frame_order.copy_(torch.tensor([f % cache.ring_frames for f in frames], dtype=torch.int32))
        for layer in range(self.n_blocks):
            gather_window(cache.k[layer], cache.v[layer], cache.k_scale[layer], cache.v_scale[layer], self.frame_order,
                          cache.sink_slots, cache.tokens_per_frame, (self.k[layer], self.v[layer]))

    def warm(self) -> None:
        """Gather once now: the gather's kernel compiles at its first call, which is otherwise the step that
        first finds the window full (that step stalled ~0.9 s on the H200: a held frame in every session).
        What it writes is rebuilt at that step."""
        if self.mirrors is None:
            self.gather([0] * self.window_frames)


class GatheredBackend(StepAttention):
    name = "gathered"

    def __init__(self, write: RingWrite, model: DiT) -> None:
        super().__init__(write)
        self.window = Window(model, write.cache, model.head.weight.dtype)

    def prepare(self) -> None:
        self.window.prepare()

    def warm(self) -> None:
        self.window.warm()

    def forward(self, layer, q, k, v, cq, rotation) -> Output:
        window = self.window.layer(layer)
        self.write(layer, q, k, v, cq, rotation, window=window)
        # cuDNN's own buffer, read there by quantize_rows, not copied over v
        return window_attention(q, *window[:2]).flatten(1), None


class Fp8WindowBackend(StepAttention):
    name = "fp8_window"

    def __init__(self, write: RingWrite, model: DiT, window_splits: int | None) -> None:
        super().__init__(write)
        cfg, cache, block = model.cfg, write.cache, model.blocks[0]
        dev, t, heads, head_dim = cache.k.device, cfg.tokens_per_step, block.n_heads, block.head_dim
        self.window = Window(model, cache, FP8_DTYPE)  # half the bf16 window's bytes
        self.q8 = torch.empty(t, heads, head_dim, dtype=FP8_DTYPE, device=dev)
        n_keys = self.window.k.shape[2]
        if window_splits is None:
            sms = torch.cuda.get_device_properties(dev).multi_processor_count
            window_splits = choose_window_splits(heads, t, n_keys, sms)
        # with more than one partition, cuDNN writes each one's output and statistics and merge_partials
        # writes their merge over spent v
        parts = (window_splits,) if window_splits > 1 else ()
        self.attn8 = torch.empty(*parts, *self.q8.shape, dtype=FP8_DTYPE, device=dev)
        self.attn_lse = torch.empty(window_splits, heads, t, device=dev) if window_splits > 1 else None
        self.attention = Fp8WindowAttention(heads, t, n_keys, head_dim, self.q8.stride(), 1.0 / math.sqrt(head_dim),
                                            dev, splits=window_splits)
        self.unit = torch.ones(1, device=dev)  # K's and V's descales: their scales fold into q's codes and the rows' read
        # per layer: q's descale and its codes' multipliers per head, the output's scales per head (set from
        # the cache's scales whenever the window is gathered: a new session's sink sets them)
        self.q_descale = torch.ones(cfg.n_blocks, 1, device=dev)
        self.q_mult = torch.ones(cfg.n_blocks, heads, device=dev)
        self.out_scale = torch.ones(cfg.n_blocks, heads, device=dev)
        self.scale_o = torch.full((1,), FP8_OUTPUT_SCALE, device=dev)
        # |RoPE(q_norm(q))| <= sqrt(head_dim) x max |q_norm weight| per element (an RMS-normalised row has
        # squared norm head_dim; RoPE keeps each pair's norm), plus bf16's rounding
        self.q_bound = torch.stack([b.q_norm.weight.detach().float().abs().amax() for b in model.blocks]) * (
            math.sqrt(head_dim) * (1 + 2.0**-7))

    @property
    def splits(self) -> int:
        return self.attention.splits

    def prepare(self) -> None:
        if self.window.prepare():
            self._scales()

    def warm(self) -> None:
        if self.window.mirrors is None:
            self.window.warm()
            self._scales()

    def _scales(self) -> None:
        # K's scales fold into q's codes (under e4m3's largest), V's apply to the output
        cache = self.cache
        self.q_descale.copy_(self.q_bound[:, None] * cache.k_scale.amax(dim=1, keepdim=True) / FP8_MAX)
        self.q_mult.copy_(cache.k_scale / self.q_descale)
        self.out_scale.copy_(cache.v_scale / FP8_OUTPUT_SCALE)

    def forward(self, layer, q, k, v, cq, rotation) -> Output:
        window = self.window.layer(layer)
        self.write(layer, q, k, v, cq, rotation, window=window, q8=(self.q8, self.q_mult[layer]))
        self.attention(self.q8, *window[:2], self.q_descale[layer], self.unit, self.unit, self.scale_o,
                       self.attn8, self.attn_lse)
        if self.attn_lse is not None:
            merge_partials(self.attn8, self.attn_lse, self.out_scale[layer], v)
            return None, None
        return self.attn8.flatten(1), self.out_scale[layer]
