"""`charstream model info` on the meta device, and weights that round-trip through safetensors."""

from __future__ import annotations

import json

import pytest
import torch

from charstream.model.config import TINY
from charstream.model.dit import DiT
from charstream.model.weights import build_model, save_weights
from charstream.pipeline.cli import main


@pytest.mark.parametrize("tp", [3, 4])
def test_characters_57b_info(tp, capsys):
    assert main(["model", "info", "--preset", "characters-57b", "--tp", str(tp), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert 45e9 <= info["params_total"] <= 65e9
    # blocks are split; embeddings, adaLN and the head (~0.4 B) are replicated
    assert info["params_total"] / tp < info["params_per_rank"] < info["params_total"] / tp + 0.4e9
    assert info["tokens_per_step"] == 757 and info["heads_per_rank"] == 60 // tp
    # FP8 K/V: one byte per value, the bf16 cache two (plus the fp32 per-head scales)
    assert info["kv_bytes_per_rank_bf16"] == 2 * (info["kv_bytes_per_rank_fp8"] - 8 * 60 * (60 // tp))
    assert info["all_reduces_per_step"] == 240
    assert 2e14 < info["flops_per_step_total"] < 5e14  # ~ 2 x 757 tokens x 4 passes x 57 B + attention
    # a step is a chunk of 4 frames at 24 fps: 6 a second; its latent frame's decode is counted too; the
    # bound counts the TP group's accelerators
    assert 0 < info["flops_decode_per_chunk"] < 0.01 * info["flops_per_step_total"]
    assert info["flops_per_video_second"] == pytest.approx(
        6 * (info["flops_per_step_total"] + info["flops_decode_per_chunk"]), rel=1e-9)
    assert main(["model", "info", "--preset", "characters-57b", "--tp", str(tp), "--peak-tflops", "1979", "--json"]) == 0
    bound = json.loads(capsys.readouterr().out)
    assert bound["sessions_at_most"] == int(tp * 1979e12 // info["flops_per_video_second"]) >= 2


def test_characters_14b_fits_one_gpu(capsys):
    """The one-H200 preset: ~14 B parameters, the 57b's timeline (757 tokens per step), 40 blocks."""
    assert main(["model", "info", "--preset", "characters-14b", "--tp", "1", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert 13e9 <= info["params_total"] <= 15e9 and info["params_per_rank"] == info["params_total"]
    assert info["tokens_per_step"] == 757 and info["heads_per_rank"] == 40
    assert info["all_reduces_per_step"] == 0  # TP = 1
    # bf16 weights + their FP8 copies + the FP8 cache leave most of an H200's 141 GB free
    assert 3 * info["params_total"] + info["kv_bytes_per_rank_fp8"] < 60e9


def test_info_rejects_an_indivisible_tp(capsys):
    with pytest.raises(SystemExit, match="charstream model info: .*not divisible by the tensor-parallel size 7"):
        main(["model", "info", "--preset", "characters-57b", "--tp", "7"])


def test_weights_round_trip(tmp_path):
    cfg = TINY.with_(n_blocks=2)
    model = DiT(cfg).init_random_(seed=9)
    save_weights(model, tmp_path / "w.safetensors")
    loaded = build_model(cfg, tmp_path / "w.safetensors")
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="lacks|lack"):
        build_model(TINY.with_(n_blocks=3), tmp_path / "w.safetensors")


def test_bench_model_reports_step_and_decode(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "model", "--preset", "tiny", "--steps", "2", "--warmup", "0", "--json", "--out", str(out)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report == json.loads(out.read_text())
    assert report["passes_per_step"] == 4 and report["steps"] == 2
    total = report["step"]["median_ms"] + report["decode"]["median_ms"]
    assert report["step_plus_decode_median_ms"] == pytest.approx(total)
    assert report["budget_fraction"] == pytest.approx(total / (1000 * 4 / 24))
