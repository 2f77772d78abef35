"""The turn-start estimate from the speech chunk's own production: its parts, their quantile, and
the allowance learned from recent speech chunks' errors."""

from __future__ import annotations

import pytest

from charstream.stages.playout.speech_estimate import PRIOR_TURNS, SpeechEstimator, nearest_rank

INITIAL_ALLOWANCE_S = 1 / 24  # these tests' prior (PlayoutConfig's default is a chunk)


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


def test_the_sessions_first_chunk_sets_no_estimate():
    """Its decode paid the session's one-off costs: 2.4 s where the next five took 0.1 s."""
    est = observed([(0.490, 2.426)] + [(0.310, 0.100)] * 5)
    estimate = est.estimate(2000.0, 0.0, None)
    assert (estimate.step_s, estimate.delivery_s) == pytest.approx((0.310, 0.100))
    assert not observed([(0.490, 2.426)]).measured  # nothing counted yet: no estimate


def test_one_slow_chunk_does_not_set_the_estimate_but_a_tenth_of_them_does():
    parts = [(0.110, 0.040)] * 47 + [(0.800, 0.300)]  # one queued / paused chunk in 48
    assert observed(parts).estimate(2000.0, 0.0, None).expected_s == pytest.approx(0.150)
    parts = [(0.110, 0.040)] * 40 + [(0.200, 0.060)] * 8  # 1 in 6 slow: the 90th percentile is slow
    assert observed(parts).estimate(2000.0, 0.0, None).expected_s == pytest.approx(0.260)


def test_chunks_queued_behind_each_other_measure_their_own_step():
    est = SpeechEstimator(initial_allowance_s=0.0)
    for i in range(8):  # a session's first chunks, all ready at once: each step 100 ms, one after another
        done = 1000.0 + 0.100 * (i + 1)
        est.observe({"conditioning_ready": 1000.0, "diffusion_done": done}, done + 0.030)
    # from ready, the eighth waited 700 ms in the queue; its step (and the 90th percentile's) is 100 ms
    assert est.estimate(2000.0, 0.0, None).expected_s == pytest.approx(0.100 + 0.030)


@pytest.mark.parametrize("waits_for_decode", [True, False])
def test_a_chunk_motion_models_chunks_measure_their_step_from_the_decode_before(waits_for_decode):
    """Listening chunks of a chunk-motion model, each conditioned ahead: a chunk's denoise (330 ms) starts
    once the chunk before is decoded (210 ms after its denoise), so from its conditioning it took 540 ms,
    of which the speech's first chunk, made after a rollback, waits for none. Without ``waits_for_decode``
    (the characters' step, which a decode does not hold up) that wait counts."""
    est = SpeechEstimator(initial_allowance_s=0.0, waits_for_decode=waits_for_decode)
    decoded = 1000.0  # the chunk before's decode_done
    for _ in range(12):
        ready = decoded - 0.210  # conditioned while the chunk before decodes
        done = decoded + 0.330  # its denoise starts once that decode is done
        decoded = done + 0.210
        est.observe({"conditioning_ready": ready, "diffusion_done": done, "decode_done": decoded}, decoded + 0.020)
    assert est.step_s() == pytest.approx(0.330 if waits_for_decode else 0.540)


def test_chunks_decoded_in_parts_measure_their_step_from_the_last_part_and_deliver_the_first():
    """As above, each chunk's decode in two parts: its first frames 90 ms after its denoise (``decode_done``,
    their arrival 20 ms later), the rest 120 ms after (``decode_rest_done``). The next chunk's step starts
    at the rest's end; the delivery a turn's first frame waits for is the first part's."""
    est = SpeechEstimator(initial_allowance_s=0.0, waits_for_decode=True)
    decoded = 1000.0  # the chunk before's decode_rest_done
    for _ in range(12):
        ready = decoded - 0.210
        done = decoded + 0.330
        stamps = {"conditioning_ready": ready, "diffusion_done": done, "decode_done": done + 0.090}
        est.observe(stamps, done + 0.110)
        decoded = done + 0.210
        est.decoded(stamps | {"decode_rest_done": decoded})
    estimate = est.estimate(2000.0, 0.0, None)
    assert est.step_s() == pytest.approx(0.330) and estimate.delivery_s == pytest.approx(0.110)


def test_the_allowance_is_the_recent_speech_chunks_second_latest_error():
    est = observed([(0.110, 0.040)] * 30)
    assert est.end_turn() is None and est.allowance_s == INITIAL_ALLOWANCE_S  # nothing arrived: unchanged
    for error in (0.060, 0.010, 0.000):  # its first chunk 60 ms late, the next ones about on time
        est.speech_arrived(error)
    turn = est.end_turn()
    assert (turn.chunks, turn.first_s, turn.max_s) == (3, 0.060, 0.060)
    assert est.allowance_s == pytest.approx(0.060)  # the turn's latest error, above the halved prior
    assert est.estimate(2000.0, 0.0, None).ready_s == pytest.approx(0.150 + 0.060)
    for error in (0.030, -0.050, -0.050):  # a turn at a pace ahead of real time: only its first chunk late
        est.speech_arrived(error)
    est.end_turn()
    assert est.allowance_s == pytest.approx(0.030)  # one turn in the history (the first's forgotten): its latest
    for error in (0.020, -0.050, -0.050):
        est.speech_arrived(error)
    est.end_turn()
    assert est.allowance_s == pytest.approx(0.020)  # two turns: the second latest


def test_the_prior_halves_with_each_measured_turn_and_holds_while_the_errors_say_less():
    est = observed([(0.110, 0.040)] * 30)
    assert est.allowance_s == INITIAL_ALLOWANCE_S
    for n in range(1, PRIOR_TURNS + 2):
        for error in (0.001, -0.050, -0.050):  # every turn about on time: the errors alone would allow 1 ms
            est.speech_arrived(error)
        est.end_turn()
        prior = INITIAL_ALLOWANCE_S / 2 ** n if n < PRIOR_TURNS else 0.0
        assert est.prior_s == pytest.approx(prior)
        assert est.allowance_s == pytest.approx(max(prior, 0.001)), n  # the larger of the two
    assert est.allowance_s == pytest.approx(0.001)  # after the prior's turns: the errors alone
    est.end_turn()  # a turn whose speech never arrived measures nothing
    assert est.turns_measured == PRIOR_TURNS + 1


def test_one_stall_sets_nothing_a_recurring_lateness_does_and_it_spans_turns():
    est = SpeechEstimator(initial_allowance_s=0.0)  # the errors alone
    for _ in range(32):  # the first turn, beside the warm-up: late, then forgotten
        est.speech_arrived(0.100)
    est.end_turn()
    assert est.allowance_s == pytest.approx(0.100)
    for turn in range(8):  # 8 turns of 32 chunks: about on time, one stall of 400 ms in all of them
        for k in range(32):
            est.speech_arrived(0.400 if (turn, k) == (3, 10) else -0.010)
        est.end_turn()
        assert est.allowance_s == 0.0  # the stall is the latest of the 256 (the first turn's are gone)
    for _ in range(2):  # two turns, each with one chunk 20 ms behind its schedule (a frame held)
        for k in range(32):
            est.speech_arrived(0.020 if k == 5 else -0.010)
        est.end_turn()
    assert est.allowance_s == pytest.approx(0.020)  # the second latest of the last 256
    for _ in range(8):  # 256 chunks on time later, the late ones have left the history
        for _k in range(32):
            est.speech_arrived(-0.010)
        est.end_turn()
    assert est.allowance_s == 0.0


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="quantile"):
        SpeechEstimator(quantile=0.0, initial_allowance_s=0.0)
    with pytest.raises(ValueError, match="error history"):
        SpeechEstimator(error_history=1, initial_allowance_s=0.0)
    with pytest.raises(ValueError, match="initial allowance"):
        SpeechEstimator(initial_allowance_s=-0.1)
