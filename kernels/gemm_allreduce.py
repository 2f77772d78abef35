"""Row-parallel output projection fused with its all-reduce (the one collective per block).

``gemm_all_reduce_reference``: the whole GEMM, then one all-reduce -- what every step runs today.
(An earlier decomposition into row tiles, each handed to an asynchronous all-reduce while the next
tile's GEMM ran, measured slower than this on 2 x H200 and is gone: docs/PERF.md.)

``Fp8GemmAllReduce``: the FP8 GEMM and the all-reduce in one persistent Triton launch over CUDA IPC
buffers, the mechanism custom all-reduce kernels use: each rank writes its partial output tiles
into a buffer every peer has mapped (handles exchanged once over the group, any backend), raises a
per-tile flag, and reduces each of its tiles one-shot (reading the W partials of that tile) as
soon as the peers' flags for it are up -- so the reduction of early tiles overlaps the GEMM of
later ones on the peers. Off by default and wired nowhere yet: an entry point the step can call.
It runs wherever the ranks' GPUs can map each other's memory; it is checked with 2 and 4 rank
processes sharing one GPU (tests/test_gemm_allreduce_gpu.py), where NCCL refuses duplicate devices.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import triton
import triton.language as tl
from torch.multiprocessing.reductions import reduce_tensor

Linear = Callable[[torch.Tensor], torch.Tensor]


def gemm_all_reduce_reference(x: torch.Tensor, linear: Linear, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``linear(x)`` summed over the TP group: the plain GEMM-then-collective path."""
    out = linear(x)
    dist.all_reduce(out, group=group)
    return out


@triton.jit
def _wait_flag(flag_ptr, at_least):
    # Spin until another rank's release store reaches at_least (acquire: its data is then visible).
    seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
    while seen < at_least:
        seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")


@triton.jit
def _fp8_gemm_all_reduce_kernel(
    a, a_scale, w, w_scale, buffers, flags, out, epoch_ptr, M, N, K, rank,
    WORLD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # Persistent: program p owns tiles p, p + P, ... in both phases. Phase 1: each tile's FP8 GEMM
    # (row-wise A scales, per-output-feature W scales, fp32 accumulation) goes to this rank's shared
    # buffer, then its ready flag is set to this call's epoch. Phase 2: each tile summed over the
    # WORLD buffers once every peer's ready flag for it is up; then this rank's done flag for the
    # tile says it has read the peers' copies, which a peer waits for before overwriting that tile
    # in the next call. flags[r] rows: [0, n_tiles) ready, [n_tiles, 2 n_tiles) done.
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    n_n = tl.cdiv(N, BLOCK_N)
    n_tiles = tl.cdiv(M, BLOCK_M) * n_n
    epoch = tl.load(epoch_ptr) + 1
    own = tl.load(buffers + rank).to(tl.pointer_type(tl.bfloat16))
    own_flags = tl.load(flags + rank).to(tl.pointer_type(tl.int32))
    rk = tl.arange(0, BLOCK_K)
    for tile in range(pid, n_tiles, n_prog):
        rm = (tile // n_n) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = (tile % n_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            at = tl.load(a + rm[:, None] * K + kk[None, :], mask=(rm < M)[:, None] & (kk < K)[None, :], other=0.0)
            wt = tl.load(w + rn[:, None] * K + kk[None, :], mask=(rn < N)[:, None] & (kk < K)[None, :], other=0.0)
            acc = tl.dot(at, tl.trans(wt), acc)
        acc *= tl.load(a_scale + rm, mask=rm < M, other=0.0)[:, None] * tl.load(w_scale + rn, mask=rn < N, other=0.0)[None, :]
        for r in tl.static_range(WORLD):
            if r != rank:  # the peer has read this tile of the previous call
                _wait_flag(tl.load(flags + r).to(tl.pointer_type(tl.int32)) + n_tiles + tile, epoch - 1)
        mask = (rm < M)[:, None] & (rn < N)[None, :]
        tl.store(own + rm[:, None] * N + rn[None, :], acc.to(tl.bfloat16), mask=mask)
        tl.debug_barrier()  # every thread's part of the tile is stored before the flag goes up
        tl.atomic_xchg(own_flags + tile, epoch, sem="release", scope="sys")
    for tile in range(pid, n_tiles, n_prog):
        rm = (tile // n_n) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = (tile % n_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (rm < M)[:, None] & (rn < N)[None, :]
        offs = rm[:, None] * N + rn[None, :]
        total = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for r in tl.static_range(WORLD):
            if r != rank:
                _wait_flag(tl.load(flags + r).to(tl.pointer_type(tl.int32)) + tile, epoch)
            part = tl.load(buffers + r).to(tl.pointer_type(tl.bfloat16))
            total += tl.load(part + offs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)  # L2, not L1
        tl.store(out + offs, total.to(out.dtype.element_ty), mask=mask)
        tl.debug_barrier()
        tl.atomic_xchg(own_flags + n_tiles + tile, epoch, sem="release", scope="sys")


class Fp8GemmAllReduce:
    """``(xq * x_scale) @ (w * w_scale)^T`` summed over the group's ranks, for inputs of exactly ``rows``
    rows and ``out_features`` outputs, in one launch (plus a one-element epoch increment).

    Construction is collective: every rank allocates its partial-output buffer and flags and maps
    every peer's through CUDA IPC (handles exchanged with ``all_gather_object`` over ``group``, e.g.
    gloo). ``programs``: the persistent grid (default one per SM). ``nbytes``: device memory held."""

    def __init__(
        self,
        rows: int,
        out_features: int,
        group: dist.ProcessGroup | None,
        device: torch.device | str,
        block: tuple[int, int, int] = (128, 256, 128),
        num_warps: int = 8,
        num_stages: int = 3,
        programs: int | None = None,
    ) -> None:
        self.rows, self.out_features, self.block = rows, out_features, block
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.launch = {"num_warps": num_warps, "num_stages": num_stages}
        device = torch.device(device)
        n_tiles = triton.cdiv(rows, block[0]) * triton.cdiv(out_features, block[1])
        self.programs = min(n_tiles, programs or torch.cuda.get_device_properties(device).multi_processor_count)
        self.buffer = torch.zeros(rows, out_features, dtype=torch.bfloat16, device=device)
        self.flags = torch.zeros(2 * n_tiles, dtype=torch.int32, device=device)
        self.epoch = torch.zeros(1, dtype=torch.int32, device=device)
        torch.cuda.synchronize(device)  # zeroed before any peer maps them
        handles: list[object] = [None] * self.world
        if self.world > 1:  # a group of one maps nothing
            dist.all_gather_object(handles, (reduce_tensor(self.buffer), reduce_tensor(self.flags)), group=group)
        # peers' tensors stay referenced here: dropping them would unmap the memory under the kernel
        self.peers = [(self.buffer, self.flags) if r == self.rank else tuple(fn(*args) for fn, args in h)
                      for r, h in enumerate(handles)]
        self.buffer_ptrs = torch.tensor([b.data_ptr() for b, _ in self.peers], dtype=torch.int64, device=device)
        self.flag_ptrs = torch.tensor([f.data_ptr() for _, f in self.peers], dtype=torch.int64, device=device)
        dist.barrier(group=group)  # every rank mapped every buffer before any kernel writes a flag

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * 2 + self.flags.numel() * 4

    def __call__(
        self, xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """xq (rows, K) float8_e4m3fn, x_scale (rows, 1) float32, weight (out_features, K) float8_e4m3fn,
        w_scale (out_features,) or (1, out_features) float32 -> the group's sum, bf16 (rows, out_features).
        Every rank calls it in the same order (a collective)."""
        k = xq.shape[1]
        if xq.shape[0] != self.rows or weight.shape != (self.out_features, k):
            raise ValueError(f"expected xq ({self.rows}, K) and weight ({self.out_features}, K), got "
                             f"{tuple(xq.shape)} and {tuple(weight.shape)}")
        if not (xq.is_contiguous() and weight.is_contiguous()):
            raise ValueError("xq and weight need contiguous rows")
        out = torch.empty(self.rows, self.out_features, dtype=torch.bfloat16, device=xq.device) if out is None else out
        bm, bn, bk = self.block
        _fp8_gemm_all_reduce_kernel[(self.programs,)](
            xq, x_scale, weight, w_scale, self.buffer_ptrs, self.flag_ptrs, out, self.epoch,
            self.rows, self.out_features, k, self.rank,
            WORLD=self.world, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, **self.launch,
        )
        self.epoch += 1  # on the device, after the kernel: a CUDA graph replays it too
        return out
