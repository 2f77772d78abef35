"""``charstream bench gpu`` off the GPU: a clear refusal, and its table from a recorded JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from charstream.pipeline.bench.gpu import _table, memset_sources, trace_summary
from charstream.pipeline.cli import main

RECORDED = Path(__file__).resolve().parent / "data" / "bench_gpu_tp3_tp4.json"  # one H200, torch 2.11


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_refuses_without_cuda(capsys):
    assert main(["bench", "gpu"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().out


def test_table_puts_measured_beside_target_and_reference():
    results = json.loads(RECORDED.read_text())
    table = _table(results)
    step_row = next(line for line in table.splitlines() if line.startswith("step TP=3 shard, graphed"))
    assert f"{results['shards']['3']['step']['step_graphed_ms']:.1f}" in step_row
    assert "<= 112.0" in step_row and "147.4" in step_row
    decoder_row = next(line for line in table.splitlines() if line.startswith("decoder 704x1088"))
    assert f"{results['decoder']['graphed_bf16_ms']:.2f}" in decoder_row and "114" in decoder_row


def test_trace_summary_places_memset_nodes_at_their_kernel_boundary():
    """A replay's trace: two blocks of gemm -> norm -> gemm, a memset node before each second gemm (the
    long gap), the launch call before the first kernel."""
    events = [{"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 0.0, "dur": 50.0}]
    t = 100.0
    for _ in range(2):
        for name, dur, gap in (("gemm(a)", 10.0, 1.0), ("norm", 2.0, 1.0), ("gemm(b)", 10.0, 5.0)):
            if name == "gemm(b)":
                events.append({"ph": "X", "cat": "gpu_memset", "name": "Memset", "ts": t + 1.5, "dur": 1.0,
                               "args": {"bytes": 16}})
            t += gap
            events.append({"ph": "X", "cat": "kernel", "name": name, "ts": t, "dur": dur})
            t += dur
    summary = trace_summary(events)
    assert summary["kernels"] == 6
    assert summary["gaps_ms"] * 1e3 == pytest.approx(1 + 5 + 1 + 1 + 5)  # the first kernel's lead-in is no gap
    assert summary["gap_ms_by_boundary"]["norm -> gemm"] == {"ms": 0.01, "count": 2}
    assert summary["copy_nodes_by_boundary"] == {"gpu_memset: norm -> gemm": {
        "ms": 0.002, "count": 2, "bytes_each": 16, "idle_before_us_each": 1.5, "idle_after_us_each": 2.5}}
    assert summary["graph_launch_start_to_first_kernel_us"] == 101.0
    assert summary["busy_ms"] * 1e3 == pytest.approx(44.0)


def test_memset_sources_names_the_operator_around_each_memset_call():
    """An eager run's trace: a memset asked inside the GEMM's operator, one inside the attention's inner
    operator, one outside any operator; a kernel launch (a fill of ours) and another thread's operator
    at the same moment are not memsets of these operators."""
    op = lambda name, ts, dur, tid=1: {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "tid": tid}  # noqa: E731
    call = lambda name, ts, corr, tid=1: {"ph": "X", "cat": "cuda_runtime", "name": name, "ts": ts, "dur": 1.0,  # noqa: E731
                                          "tid": tid, "args": {"correlation": corr}}
    gpu = lambda corr, nbytes: {"ph": "X", "cat": "gpu_memset", "name": "Memset", "ts": 500.0 + corr, "dur": 1.0,  # noqa: E731
                                "args": {"correlation": corr, "bytes": nbytes}}
    events = [
        op("aten::_scaled_mm", 10, 20), call("cudaMemsetAsync", 12, 1), gpu(1, 16), call("cudaLaunchKernel", 20, 2),
        op("aten::scaled_dot_product_attention", 40, 40), op("aten::_scaled_dot_product_cudnn_attention", 42, 36),
        op("aten::copy_", 45, 100, tid=2), call("cudaMemsetAsync", 50, 3), gpu(3, 4),
        op("aten::fill_", 85, 5), call("cudaLaunchKernel", 86, 4),
        call("cuMemsetD32Async", 95, 5), gpu(5, 8),
        op("aten::_scaled_mm", 100, 20), call("cudaMemsetAsync", 101, 6), gpu(6, 16),
    ]
    assert memset_sources(events) == {
        "aten::_scaled_mm": {"count": 2, "bytes": 32},
        "aten::scaled_dot_product_attention > aten::_scaled_dot_product_cudnn_attention": {"count": 1, "bytes": 4},
        "(no operator)": {"count": 1, "bytes": 8},
    }
