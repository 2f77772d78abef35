"""KV ring cache of one TP rank: sink slots + a ring of frames, all layers in one tensor each.

Layout (the contract with kernels/): ``k``, ``v`` are (n_layers, n_heads, n_slots, head_dim) in
float8_e4m3fn or the model dtype; ``k_scale``, ``v_scale`` float32 (n_layers, n_heads). Slots are
the sink (``sink_frames * T``) followed by ``ring_frames * T`` ring slots; absolute frame ``f``
lives at ring position ``f % ring_frames``. Storage is allocated once and never reallocated.

Keys carry RoPE and FP8 from the moment they are written; attention reads the ring in place under
the ``ring_valid`` mask. Time positions: the sink sits at ``t = 0 .. sink_frames - 1``; frame ``f``
at ``t = sink_frames + f - offset(f)`` where the offset grows by ``reset_every`` each time the
newest position would reach ``sink_frames + window + reset_every`` -- one delta rotation of the
ring keys moves every cached frame back with it.

Scale policy (FP8): a layer's per-head scales are set when the sink frame is written --
K: headroom x the largest (even, odd) pair norm / 448 (a pair's norm bounds both rotated values
at every position, so RoPE can never push a key past the range the sink saw); V: headroom x amax / 448.
Later values beyond the range saturate at +-448 and are counted in ``saturated``.

Storage lives in a ``KVPool``: the same tensors for ``lanes`` sessions, lane-major, so one batched
step (model/step/batched.py's ``BatchedStep``) writes and attends every session's ring at once, each lane
with its own scales, validity, write pointer and positions. A ``KVCache`` is one session's ring:
its tensors are views of its lane, its bookkeeping (frames, offset, pointer) its own. A cache made
without a pool gets a pool of one lane, i.e. exactly the layout above.
"""

from __future__ import annotations

import math

import torch

from charstream.kernels.delta_rotate import delta_rotate
from charstream.kernels.fp8 import FP8_MAX, as_bits, is_fp8, quantize
from charstream.kernels.ring_attention import ring_attention, ring_slot_bias
from charstream.kernels.ring_write import ring_write
from charstream.kernels.rope import RopeFreqs, rotate_complex
from charstream.model.config import ModelConfig


def position_offset(frame: int, window_frames: int, reset_every: int) -> int:
    """Time offset in force while frame ``frame`` is written (a multiple of ``reset_every``)."""
    return reset_every * max(0, (frame - window_frames) // reset_every)


def _needed_slots(cfg: ModelConfig, n_slots: int | None) -> int:
    needed = cfg.storage_slots
    if n_slots is not None and n_slots < needed:
        raise ValueError(
            f"KV cache of {n_slots} slots cannot hold {cfg.sink_frames} sink + {cfg.window_frames} window "
            f"+ {cfg.rollback_frames} rollback frames x {cfg.tokens_per_step} tokens = {needed} slots"
        )
    return needed


class KVPool:
    """The ring storage of ``lanes`` sessions: ``k``, ``v`` (lanes, n_layers, n_heads, n_slots, head_dim),
    ``k_scale``, ``v_scale`` (lanes, n_layers, n_heads), ``ring_valid`` (lanes, ring_frames), ``saturated``
    (lanes,). ``write`` and ``attend`` serve a batch of lanes with every index on the device (a CUDA
    graph replays them with moving pointers)."""

    def __init__(
        self,
        cfg: ModelConfig,
        n_heads: int,
        dtype: torch.dtype,
        device: torch.device | str,
        freqs: RopeFreqs,
        lanes: int = 1,
        n_slots: int | None = None,
    ) -> None:
        self.cfg, self.freqs, self.lanes = cfg, freqs, lanes
        self.tokens_per_frame = cfg.tokens_per_step
        self.sink_slots = cfg.sink_frames * self.tokens_per_frame
        shape = (lanes, cfg.n_blocks, n_heads, _needed_slots(cfg, n_slots), cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.k_scale = torch.ones(lanes, cfg.n_blocks, n_heads, dtype=torch.float32, device=device)
        self.v_scale = torch.ones_like(self.k_scale)
        self.ring_valid = torch.zeros(lanes, cfg.ring_frames, dtype=torch.bool, device=device)
        self.saturated = torch.zeros(lanes, dtype=torch.int64, device=device)
        self.heads = torch.arange(n_heads, device=device)

    @property
    def fp8(self) -> bool:
        return is_fp8(self.k)

    def slot_bias(self, lanes: torch.Tensor) -> torch.Tensor:
        """Additive attention bias (B, n_slots) of ``lanes``: 0 for the sink and valid ring frames, -inf
        elsewhere (``ring_slot_bias`` per lane, from the device validity)."""
        ring = torch.where(self.ring_valid[lanes], 0.0, float("-inf")).repeat_interleave(self.tokens_per_frame, dim=1)
        return torch.cat([ring.new_zeros(len(lanes), self.sink_slots), ring], dim=1)

    def write(self, layer: int, lanes: torch.Tensor, slot_start: torch.Tensor, k_new: torch.Tensor,
              v_new: torch.Tensor, rotation: torch.Tensor) -> None:
        """Write pre-RoPE K/V (B, T, n_heads, head_dim) of one frame per lane at ``slot_start`` (B,);
        ``rotation``: the frames' ``complex_rotation`` tables (B, T, 1, head_dim // 2)."""
        n_tokens = k_new.shape[1]
        k_scale, v_scale = self.k_scale[lanes, layer][:, None, :, None], self.v_scale[lanes, layer][:, None, :, None]
        if self.fp8:
            self.saturated.index_add_(0, lanes, _over_range(k_new, v_new, k_scale, v_scale))
        k_stored = quantize(rotate_complex(k_new, rotation), k_scale, self.k.dtype)
        v_stored = quantize(v_new.float(), v_scale, self.v.dtype)
        slots = slot_start[:, None] + torch.arange(n_tokens, device=slot_start.device)
        index = (lanes[:, None, None], self.heads[None, None, :], slots[:, :, None])  # (B, T, heads) of (lanes, H, S)
        as_bits(self.k[:, layer]).index_put_(index, as_bits(k_stored))
        as_bits(self.v[:, layer]).index_put_(index, as_bits(v_stored))

    def attend(self, layer: int, lanes: torch.Tensor, q: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """Attention of RoPE'd queries (B, T, n_heads, head_dim), one frame per lane, over each lane's
        sink + valid ring frames (``bias``: ``slot_bias(lanes)``); the math of ``ring_attention_cpu``. The
        lanes' K/V are gathered, (B, n_heads, n_slots, head_dim) per layer: a batch's lanes lie anywhere."""
        k, v = self.k[lanes, layer].float(), self.v[lanes, layer].float()
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
        # FP8: the scales fold into the queries (K) and the output (V)
        qh = q.float().transpose(1, 2) * (self.k_scale[lanes, layer][:, :, None, None] * softmax_scale
                                          if self.fp8 else softmax_scale)
        out = torch.softmax((qh @ k.mT).add_(bias[:, None, None, :]), dim=-1) @ v
        if self.fp8:
            out = out * self.v_scale[lanes, layer][:, :, None, None]
        return out.transpose(1, 2).to(q.dtype)


class KVCache:
    """One session's ring: lane ``lane`` of ``pool`` (a pool of its own when None)."""

    def __init__(
        self,
        cfg: ModelConfig,
        n_heads: int,
        dtype: torch.dtype,
        device: torch.device | str,
        freqs: RopeFreqs,
        n_slots: int | None = None,
        pool: KVPool | None = None,
        lane: int = 0,
    ) -> None:
        self.cfg = cfg
        self.tokens_per_frame = cfg.tokens_per_step
        self.sink_slots = cfg.sink_frames * self.tokens_per_frame
        self.ring_frames = cfg.ring_frames
        self.pool = pool if pool is not None else KVPool(cfg, n_heads, dtype, device, freqs, 1, n_slots)
        self.lane = lane
        p = self.pool
        self.k, self.v, self.k_scale, self.v_scale = p.k[lane], p.v[lane], p.k_scale[lane], p.v_scale[lane]
        self.ring_valid, self.saturated = p.ring_valid[lane], p.saturated[lane]
        self.slot_bias = ring_slot_bias(self.ring_valid, self.sink_slots, self.tokens_per_frame)
        self.freqs = freqs
        # Host bookkeeping: which absolute frame each ring position holds (None: nothing usable).
        self.slot_frame: list[int | None] = [None] * self.ring_frames
        self.offset = 0  # time offset currently baked into the ring keys
        self.write_start = 0  # first slot of the frame being written
        self.writing_sink = False
        self.next_frame = 0
        # Bumped whenever cached history is rewritten (a new session, a rollback, a delta rotation), so
        # a copy of the ring's window (the step's bf16 attention window) knows it must be rebuilt.
        self.version = 0
        self._rotation_compiled = False  # the position reset's kernel has run once (CUDA: compiled)

    @property
    def fp8(self) -> bool:
        return is_fp8(self.k)

    def reset(self) -> None:
        """A new session: forget every frame (storage is reused, not reallocated)."""
        self.slot_frame = [None] * self.ring_frames
        self._set_valid([False] * self.ring_frames)
        if self.k.is_cuda and not self._rotation_compiled:
            self._compile_rotation()
            self._rotation_compiled = True
        self.saturated.zero_()
        self.offset = 0
        self.next_frame = 0
        self.version += 1

    def begin_sink(self) -> None:
        """Next writes go to the sink slots; attention sees the sink only."""
        self._set_valid([False] * self.ring_frames)
        self.write_start = 0
        self.writing_sink = True

    def begin_frame(self) -> tuple[int, int]:
        """Prepare to write frame ``next_frame``: apply a due position reset, mark the window valid.

        Returns (frame index, its time position). The frame's ring position counts as valid at once:
        every pass writes its K/V there before attending.
        """
        frame = self.next_frame
        ring_pos = frame % self.ring_frames
        self._shift_to(position_offset(frame, self.cfg.window_frames, self.cfg.reset_every), self._overwritten(frame))
        self.slot_frame[ring_pos] = frame
        oldest = frame - self.cfg.window_frames + 1
        valid = [f is not None and oldest <= f <= frame for f in self.slot_frame]
        self._set_valid(valid)
        self.write_start = self.sink_slots + ring_pos * self.tokens_per_frame
        self.writing_sink = False
        return frame, self.cfg.sink_frames + frame - self.offset

    def _set_valid(self, valid: list[bool]) -> None:
        """The ring frames attention may read, and on CPU the same as a per-slot bias (the CPU path's
        mask: built once here, not per layer and pass; CUDA kernels read ``ring_valid``, so building it
        there would cost launches per frame for nothing)."""
        self.ring_valid.copy_(torch.tensor(valid, dtype=torch.bool))
        if self.k.is_cpu:  # only the CPU attention reads it
            self.slot_bias = ring_slot_bias(self.ring_valid, self.sink_slots, self.tokens_per_frame)

    def end_frame(self) -> None:
        self.next_frame += 1

    def rollback(self, k: int) -> int:
        """Rewind the write pointer by ``k`` frames. Returns how many of the rewound window's frames were
        already overwritten in the ring (0 = exact: as if the dropped frames were never generated)."""
        if not 0 <= k <= self.next_frame:
            raise ValueError(f"cannot roll back {k} frames: {self.next_frame} generated this session")
        self.next_frame -= k
        self.version += 1
        self.slot_frame = [f if f is not None and f < self.next_frame else None for f in self.slot_frame]
        wanted = range(max(0, self.next_frame - self.cfg.window_frames + 1), self.next_frame)
        return sum(f not in self.slot_frame for f in wanted)

    def _overwritten(self, frame: int) -> tuple[int, int]:
        """The slots frame ``frame`` replaces, never read again: the rotation leaves them alone."""
        return self.sink_slots + frame % self.ring_frames * self.tokens_per_frame, self.tokens_per_frame

    def _compile_rotation(self) -> None:
        """Run the rotation's kernel once with the arguments of a session's first position reset: compiled
        at a reset instead, frame window + reset_every into the session, the step stalled ~1 s on the H200
        (a held frame in every session). One compile serves every reset: the arguments that move between
        resets (the skipped frame's slots, the delta) are not specialised (``kernels/delta_rotate.py``).
        Called on a ring no frame is in yet, so what it rotates is never read."""
        frame = self.cfg.window_frames + self.cfg.reset_every
        delta_rotate(self.k, self.k_scale, position_offset(frame, self.cfg.window_frames, self.cfg.reset_every),
                     self.freqs.t, self.sink_slots, self._overwritten(frame))

    def _shift_to(self, offset: int, skip: tuple[int, int]) -> None:
        if offset != self.offset:
            # One in-place rotation of every ring key's time channels: position t -> t - delta.
            delta_rotate(self.k, self.k_scale, offset - self.offset, self.freqs.t, self.sink_slots, skip)
            self.offset = offset
            self.version += 1

    def write(
        self,
        layer: int,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        positions: torch.Tensor,
        rotation: torch.Tensor | None = None,
    ) -> None:
        """Write pre-RoPE K/V (n_tokens, n_heads, head_dim) of the current frame (or the sink);
        ``rotation``: the positions' ``complex_rotation`` tables if the caller has them (the CPU path
        reuses the queries'; the CUDA kernel computes its own)."""
        k_scale, v_scale = self.k_scale[layer], self.v_scale[layer]
        if self.fp8:
            if self.writing_sink:  # the sink fixes this layer's scales for the session
                k_scale.copy_(_pair_amax(k_new) * self.cfg.kv_headroom / FP8_MAX)
                v_scale.copy_(v_new.float().abs().amax(dim=(0, 2)).clamp_min(1e-6) * self.cfg.kv_headroom / FP8_MAX)
            self.saturated += _over_range(k_new, v_new, k_scale[None, :, None], v_scale[None, :, None])
        ring_write(self.k[layer], self.v[layer], k_scale, v_scale, k_new, v_new, self.write_start, positions, self.freqs,
                   rotation)

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Attention of RoPE'd queries (n_tokens, n_heads, head_dim) over the sink + valid ring frames."""
        return ring_attention(
            q, self.k[layer], self.v[layer], self.k_scale[layer], self.v_scale[layer],
            self.ring_valid, self.sink_slots, self.tokens_per_frame, slot_bias=self.slot_bias if self.k.is_cpu else None,
        )


def _pair_amax(k: torch.Tensor) -> torch.Tensor:
    """Per head: the largest norm of an interleaved RoPE pair, (n_heads,)."""
    pairs = k.float().unflatten(-1, (-1, 2)).norm(dim=-1)
    return pairs.amax(dim=(0, 2)).clamp_min(1e-6)


def _over_range(k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor) -> torch.Tensor:
    """Values that saturate (V) or may saturate at some rotation (K pairs) under the current scales:
    k, v (..., T, n_heads, head_dim) with scales broadcastable to them; one count per leading index."""
    k_pairs = k.float().unflatten(-1, (-1, 2)).norm(dim=-1)
    over_k = (k_pairs > k_scale * FP8_MAX).flatten(-3).sum(-1)
    return over_k + (v.float().abs() > v_scale * FP8_MAX).flatten(-3).sum(-1)

