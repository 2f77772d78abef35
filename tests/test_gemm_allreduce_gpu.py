"""The fused FP8 GEMM + all-reduce over CUDA IPC (kernels/gemm_allreduce.py) against GEMM then
all-reduce, with 2 and 4 rank processes sharing one GPU (gloo carries only the handle exchange and
the reference's sum), on fresh random inputs for each of several calls (the flags' epochs and the
buffers' reuse between calls), outputs poisoned first. Skipped without CUDA.

Tolerance: both paths multiply the same FP8 operands in fp32; the fused path rounds each rank's
partial tile to bf16 before the sum and the reference sums fp32 partials, so they differ by bf16
rounding (rel. norm < 1e-2).
"""

from __future__ import annotations

import json
import os
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

M, K, N, CALLS = 757, 5120, 7680, 3  # a TP shard's output projection: 757 tokens, K = its slice


def _rank(rank: int, world: int, port: int, seed: int, out_dir: str) -> None:
    from charstream.kernels.gemm_allreduce import Fp8GemmAllReduce
    from charstream.kernels.quantize_rows import quantize_rows
    from charstream.model.fp8_linear import quantize_weight

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.cuda.set_device(0)
    gen = torch.Generator(device="cuda").manual_seed(seed + 1000 * rank)
    fused = Fp8GemmAllReduce(M, N, None, "cuda")
    report = []
    for _ in range(CALLS):
        x = torch.randn(M, K, device="cuda", generator=gen, dtype=torch.bfloat16) * 3
        w = torch.randn(N, K, device="cuda", generator=gen) * 0.02
        xq, x_scale = quantize_rows(x)
        wq, w_scale = quantize_weight(w)
        out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
        fused(xq, x_scale, wq, w_scale, out)
        partial = torch._scaled_mm(xq, wq.t(), scale_a=x_scale, scale_b=w_scale[None], out_dtype=torch.float32)
        ref = partial.cpu()
        dist.all_reduce(ref)
        got = out.float().cpu()
        report.append({"rel": ((got - ref).norm() / ref.norm()).item(), "nan": int(torch.isnan(got).sum()),
                       "partial_rel_to_sum": (partial.cpu().norm() / ref.norm()).item()})
    torch.cuda.synchronize()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("world", [2, 4])
def test_fused_gemm_all_reduce_matches_gemm_then_all_reduce(world, tmp_path):
    seed = int.from_bytes(os.urandom(4), "little")
    ctx = mp.start_processes(_rank, args=(world, _free_port(), seed, str(tmp_path)), nprocs=world, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + 90  # a missed flag would spin forever: fail instead of hanging
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"the {world} ranks did not finish in 90 s")
    for rank in range(world):
        for call in json.loads((tmp_path / f"rank{rank}.json").read_text()):
            assert call["nan"] == 0, (rank, call)
            assert call["rel"] < 1e-2, (rank, call)
            assert call["partial_rel_to_sum"] > 0.2  # the peers' partials did count
