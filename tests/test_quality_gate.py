import json

import numpy as np
import pytest
import torch

from charstream.model.weights import packaged_weights
from charstream.pipeline.quality.gate import report, score_matrix
from charstream.pipeline.quality.rollout import GateConfig, Rollout, load_config
from charstream.pipeline.quality.stats import FIXED_MARGIN, bootstrap_mean_ci, compare, drift, rerun_sd
from charstream.pipeline.training.data import make_script

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _scores(rng, clip_means, k, sd):
    return clip_means[:, None] + rng.normal(0, sd, (len(clip_means), k))


def test_same_model_passes_and_a_shift_beyond_rerun_noise_fails():
    rng = np.random.default_rng(0)
    clip_means = rng.uniform(0.6, 0.9, 20)
    base = _scores(rng, clip_means, 3, 0.02)
    same = _scores(rng, clip_means, 3, 0.02)
    worse = _scores(rng, clip_means - 0.1, 3, 0.02)
    ok = compare(base, same)
    assert ok.passed and ok.margin_kind == "rerun" and ok.ci_low < 0 < ok.ci_high
    bad = compare(base, worse)
    assert not bad.passed and bad.ci_high < -0.05  # the interval sits around the true -0.1
    assert abs(bad.mean_diff + 0.1) < 0.03
    fixed = compare(base, worse, fixed_margin=FIXED_MARGIN)
    assert fixed.margin == FIXED_MARGIN and not fixed.passed


def test_rerun_sd_and_bootstrap_ci():
    rng = np.random.default_rng(1)
    s = _scores(rng, np.zeros(200), 4, 0.05)
    assert abs(rerun_sd(s) - 0.05) < 0.005
    lo, hi = bootstrap_mean_ci(rng.normal(1.0, 1.0, 400))
    assert lo < 1.0 < hi and 0.1 < hi - lo < 0.3  # ~ +-1.96 / sqrt(400)
    with pytest.raises(ValueError, match="reruns >= 2"):
        rerun_sd(np.zeros((5, 1)))
    with pytest.raises(ValueError, match="differ in shape"):
        compare(np.zeros((3, 2)), np.zeros((4, 2)))


def test_drift_slope_flat_passes_trend_fails():
    rng = np.random.default_rng(2)
    t = np.arange(20) * 30.0 + 15.0  # 30 s windows over 10 minutes
    flat = drift(t, 0.8 + rng.normal(0, 0.01, 20), band=0.03, window_s=30)
    assert flat.passed and flat.ci_low < 0 < flat.ci_high
    falling = drift(t, 0.8 - 0.01 * t / 60 + rng.normal(0, 0.01, 20), band=0.03, window_s=30)
    assert not falling.passed and falling.ci_high < 0 and abs(falling.slope_per_min + 0.01) < 0.004


def test_config_loading_validates():
    assert load_config("fp8-ring").fp8 and load_config("naive-bf16").cache == "naive"
    with pytest.raises(FileNotFoundError, match="built-in"):
        load_config("no-such-config")
    with pytest.raises(ValueError, match="cache"):
        GateConfig(name="x", cache="paged")
    with pytest.raises(ValueError, match="ring"):
        GateConfig(name="x", cache="naive", fault="scale_x4")


# The real gate on small N: the trained character, held-out speech, CPU. Clips are 40 frames
# (the scorer's minimum is 36), N = 3 clips x K = 2 reruns per side.
N_CLIPS, K_RERUNS, N_FRAMES = 3, 2, 40


@pytest.fixture(scope="module")
def baseline_scores():
    if packaged_weights("tiny") is None:
        pytest.fail("model/assets/tiny.safetensors is missing: the gate needs the trained character")
    return score_matrix(Rollout(load_config("naive-bf16")), list(range(N_CLIPS)), K_RERUNS, N_FRAMES, "naive-bf16")


def test_gate_passes_fp8_ring_against_naive_bf16(baseline_scores, tmp_path):
    cand = score_matrix(Rollout(load_config("fp8-ring")), list(range(N_CLIPS)), K_RERUNS, N_FRAMES, "fp8-ring")
    assert baseline_scores.mean() > 0.6  # the trained character does lip-sync
    cmp = compare(baseline_scores, cand)
    assert cmp.passed, cmp
    path = report(tmp_path, load_config("naive-bf16"), load_config("fp8-ring"), cmp, baseline_scores, cand, None, 40 / 24)
    assert "PASS" in path.read_text() and (tmp_path / "gate.png").stat().st_size > 1000
    assert json.loads((tmp_path / "result.json").read_text())["comparison"]["passed"] is True


def test_gate_fails_a_broken_ring(baseline_scores):
    cand = score_matrix(Rollout(load_config("broken-scale-x4")), list(range(N_CLIPS)), K_RERUNS, N_FRAMES, "broken")
    cmp = compare(baseline_scores, cand)
    assert not cmp.passed and cmp.ci_high < 0, cmp  # worse lip sync, beyond the rerun margin


def test_heldout_cli_writes_scores_and_the_frames_figure(tmp_path):
    from charstream.pipeline.quality import heldout

    assert heldout.main(["--device", "cpu", "--clips", "2", "--reruns", "1", "--seconds", "2",
                         "--figure", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "heldout.json").read_text())
    assert result["clips"] == 2 and len(result["rows"]) == 2
    assert -1.0 <= result["mean_confidence"] <= 1.0 and result["mean_ground_truth"] > 0.8
    assert "mean confidence" in (tmp_path / "heldout.md").read_text()
    assert (tmp_path / "generated_vs_truth.png").stat().st_size > 10_000


def test_every_fault_config_generates_and_changes_the_output():
    audio = make_script(0, 24, "heldout").audio
    clean = Rollout(load_config("fp8-ring")).latents(audio, seed=0)
    for name in ("broken-scale-x4", "broken-rope-off-by-one"):
        broken = Rollout(load_config(name)).latents(audio, seed=0)
        assert broken.shape == clean.shape and torch.isfinite(broken).all()
        assert (broken - clean).norm() / clean.norm() > 1e-3, name
