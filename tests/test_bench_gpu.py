"""``charstream bench gpu`` off the GPU: a clear refusal, and its table from a recorded run's JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from charstream.pipeline.bench_gpu import _table
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
    assert "<= 120.0" in step_row and "147.4" in step_row
    decoder_row = next(line for line in table.splitlines() if line.startswith("decoder 704x1088"))
    assert f"{results['decoder']['graphed_bf16_ms']:.2f}" in decoder_row and "114" in decoder_row
