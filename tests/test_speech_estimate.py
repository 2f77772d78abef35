"""The turn-start estimate from the speech chunk's own production: its parts, their quantile, and
the allowance learned from turn errors (which decays)."""

from __future__ import annotations

import pytest
from charstream.stages.speech_estimate import SpeechEstimator, nearest_rank

INITIAL_ALLOWANCE_S = 1 / 24  # these tests' first-turn allowance (PlayoutConfig's default is a chunk)


def observed(parts: list[tuple[float, float]]) -> SpeechEstimator:
    """An estimator that saw chunks with these (step, delivery) parts."""
    est = SpeechEstimator(initial_allowance_s=INITIAL_ALLOWANCE_S)
    for i, (step, delivery) in enumerate(parts):
        ready = 1000.0 + i
        est.observe({"conditioning_ready": ready, "diffusion_done": ready + step}, ready + step + delivery)
    return est


def test_nearest_rank():
    assert nearest_rank([], 0.9) == 0.0
    assert nearest_rank([3.0, 1.0, 2.0], 0.9) == 3.0
    assert nearest_rank([float(i) for i in range(1, 11)], 0.9) == 9.0  # 10 values: the 9th, not the largest


def test_idle_step_estimate_is_encode_then_step_then_delivery():
    est = observed([(0.110, 0.040)] * 30)
    e = est.estimate(now=2000.0, encode_s=0.015, last_emit_at=2000.0 - 0.5)  # the last step ended long ago
    assert e.starts_s == pytest.approx(0.015)
    assert e.ready_s == pytest.approx(0.015 + 0.110 + 0.040 + INITIAL_ALLOWANCE_S)
    assert e.expected_s == pytest.approx(0.165)


def test_busy_step_estimate_waits_for_its_end():
    est = observed([(0.110, 0.040)] * 30)
    e = est.estimate(now=2000.0, encode_s=0.015, last_emit_at=2000.0 - 0.030)  # busy for 80 ms more
    assert e.starts_s == pytest.approx(0.080)
    assert e.expected_s == pytest.approx(0.080 + 0.110 + 0.040)


def test_one_slow_chunk_does_not_set_the_estimate_but_a_tenth_of_them_does():
    parts = [(0.110, 0.040)] * 47 + [(0.800, 0.300)]  # one queued / paused chunk in 48
    assert observed(parts).estimate(2000.0, 0.0, None).expected_s == pytest.approx(0.150)
    parts = [(0.110, 0.040)] * 40 + [(0.200, 0.060)] * 8  # 1 in 6 slow: the 90th percentile is slow
    assert observed(parts).estimate(2000.0, 0.0, None).expected_s == pytest.approx(0.260)


def test_allowance_learns_a_late_turn_and_decays():
    est = observed([(0.110, 0.040)] * 30)
    assert est.end_turn() is None and est.allowance_s == INITIAL_ALLOWANCE_S  # nothing arrived: unchanged
    for error in (0.060, 0.010, 0.000):  # its first chunk 60 ms late, the next ones about on time
        est.speech_arrived(error)
    turn = est.end_turn()
    assert (turn.chunks, turn.first_s, turn.max_s) == (3, 0.060, 0.060)
    assert est.allowance_s == pytest.approx(0.060)
    assert est.estimate(2000.0, 0.0, None).ready_s == pytest.approx(0.150 + 0.060)
    for expected in (0.030, 0.015, 0.0075):  # then turns on time (early, even): halved each turn
        est.speech_arrived(-0.050)
        est.end_turn()
        assert est.allowance_s == pytest.approx(expected)


def test_a_turn_error_is_its_latest_chunk_and_an_outlier_decays():
    est = observed([(0.110, 0.040)] * 30)
    est.speech_arrived(-0.020)
    for _ in range(19):
        est.speech_arrived(-0.010)
    est.speech_arrived(0.015)  # one chunk mid-speech 15 ms behind its schedule in 21: a held frame
    # the first measured turn replaces the initial guess (not halved into the next turns)
    turn = est.end_turn()
    assert (turn.first_s, turn.max_s, turn.error_s) == (-0.020, 0.015, 0.015) and est.allowance_s == 0.015
    est.speech_arrived(-0.020)
    est.speech_arrived(0.400)  # a stall of 400 ms mid-speech
    assert est.end_turn().error_s == pytest.approx(0.400) and est.allowance_s == pytest.approx(0.400)
    for expected in (0.200, 0.100, 0.050):  # then on time: the stall taxes the next turns less and less
        est.speech_arrived(-0.030)
        est.end_turn()
        assert est.allowance_s == pytest.approx(expected)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="quantile"):
        SpeechEstimator(quantile=0.0, initial_allowance_s=0.0)
    with pytest.raises(ValueError, match="decay"):
        SpeechEstimator(decay=1.0, initial_allowance_s=0.0)
    with pytest.raises(ValueError, match="initial allowance"):
        SpeechEstimator(initial_allowance_s=-0.1)
