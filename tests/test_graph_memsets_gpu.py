"""The libraries' counter memsets taken off a CUDA graph's critical path (model/graph_memsets.py): on a
graph of kernel -> FP8 GEMM pairs as the step has them, each GEMM's memset moves beside the kernel
before it, and the replay computes what the graph as captured computes."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

M, K, N = 757, 7680, 20480  # the TP=3 shard's input projection, whose cuBLASLt kernel asks a counter memset


def _body(x, w, w_scale, outs):
    from charstream.kernels.quantize_rows import quantize_rows_triton

    h = x
    for out in outs:
        xq, xs = quantize_rows_triton(h)  # our kernel, then the library's memset and GEMM
        out.copy_(torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=w_scale, out_dtype=torch.bfloat16,
                                   use_fast_accum=True)[:, :K])
        h = out


def _capture(keep_graph: bool, args) -> torch.cuda.CUDAGraph:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _body(*args)  # warm-up: Triton compiles, cuBLASLt picks its algorithm
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph(keep_graph=keep_graph)
    with torch.cuda.graph(graph, stream=stream):
        _body(*args)
    return graph


def test_counter_memsets_move_beside_our_kernels_and_the_replay_is_unchanged():
    from charstream.model import graph_memsets as gm
    from charstream.model.fp8_linear import quantize_weight

    gen = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
    w, w_scale = quantize_weight(torch.randn(N, K, device="cuda", generator=gen) / K**0.5)
    outs = [torch.empty(M, K, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    args = (x, w, w_scale.reshape(1, N), outs)

    plain = _capture(False, args)
    plain.replay()
    expected = [o.clone() for o in outs]

    hoisted = _capture(True, args)
    raw = hoisted.raw_cuda_graph()
    memsets = [n for n in gm._nodes(raw) if gm._node_type(n) == gm._MEMSET]
    assert memsets, "no memset captured: cuBLASLt's kernel for this shape no longer asks one (the step's premise)"
    preceding = {n: gm._edges(n, "cuGraphNodeGetDependencies") for n in memsets}
    moved = gm.hoist_counter_memsets(hoisted)
    assert moved == len(memsets)  # each follows one of our row quantizations
    for node, (ours,) in preceding.items():
        # no longer after our kernel, but after what preceded it; the GEMM after both
        assert ours not in gm._edges(node, "cuGraphNodeGetDependencies")
        assert set(gm._edges(node, "cuGraphNodeGetDependencies")) == set(gm._edges(ours, "cuGraphNodeGetDependencies"))
        gemms = gm._edges(node, "cuGraphNodeGetDependentNodes")
        assert gemms and all(g in gm._edges(ours, "cuGraphNodeGetDependentNodes") for g in gemms)
    hoisted.instantiate()
    for o in outs:
        o.fill_(float("nan"))
    for _ in range(3):
        hoisted.replay()
    torch.cuda.synchronize()
    for got, want in zip(outs, expected, strict=True):
        assert torch.equal(got, want)
