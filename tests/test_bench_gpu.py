"""``charstream bench gpu`` off the GPU: a clear refusal, and its table from a recorded run's JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from charstream.pipeline.bench_gpu import _table, trace_summary
from charstream.pipeline.cli import main

RUN1 = Path(__file__).resolve().parents[1] / "docs" / "gpu-runs" / "2026-11-29-run1-bench.json"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_refuses_without_cuda(capsys):
    assert main(["bench", "gpu"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().out


def test_table_puts_measured_beside_target_and_reference():
    results = json.loads(RUN1.read_text())
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
                events.append({"ph": "X", "cat": "gpu_memset", "name": "Memset", "ts": t + 1.5, "dur": 1.0})
            t += gap
            events.append({"ph": "X", "cat": "kernel", "name": name, "ts": t, "dur": dur})
            t += dur
    summary = trace_summary(events)
    assert summary["kernels"] == 6
    assert summary["gaps_ms"] * 1e3 == pytest.approx(1 + 5 + 1 + 1 + 5)  # the first kernel's lead-in is no gap
    assert summary["gap_ms_by_boundary"]["norm -> gemm"] == {"ms": 0.01, "count": 2}
    assert summary["copy_nodes_by_boundary"] == {"gpu_memset: norm -> gemm": {"ms": 0.002, "count": 2}}
    assert summary["graph_launch_start_to_first_kernel_us"] == 101.0
    assert summary["busy_ms"] * 1e3 == pytest.approx(44.0)
