"""The playhead's states tick by tick, without a wall clock: what each tick releases and reports."""

from __future__ import annotations

from dataclasses import replace

from charstream.stages.egress.testcard import card_chunk
from charstream.stages.playout.clock import ClockState, PlayoutClock
from charstream.stages.playout.onset import Onset
from charstream.stages.playout.speech_estimate import Estimate
from charstream.stages.playout.stats import UnderrunCause

SIZE = 16
ESTIMATE = Estimate(0.1, 0.05, 0.02, 0.0)


def ticks(clock: PlayoutClock, n: int, start: int = 0):
    return [clock.next_frame(i, float(i)) for i in range(start, start + n)]


def test_waits_for_depth_plays_then_holds_on_running_dry():
    clock = PlayoutClock(target_depth_chunks=1)
    for n in range(2):
        clock.push(card_chunk("s", n, SIZE, SIZE))
    first, *rest = ticks(clock, 9)
    assert first.resumed and first.held is None and not any(t.resumed for t in rest)
    assert [(t.frame.chunk, t.frame.frame_in_chunk) for t in [first, *rest][:8]] == [(c, i) for c in (0, 1) for i in range(4)]
    dry = rest[-1]  # the ninth frame: nothing buffered
    assert dry.underrun is UnderrunCause.LISTENING and dry.held is UnderrunCause.LISTENING and dry.frame.chunk is None
    assert (dry.frame.image == rest[-2].frame.image).all() and not dry.frame.audio.any()  # the last frame, silent
    assert clock.state is ClockState.WAITING and clock.resume_depth == 2
    clock.push(card_chunk("s", 2, SIZE, SIZE))
    held = ticks(clock, 1, 9)[0]
    assert held.held is UnderrunCause.LISTENING and held.underrun is None  # one underrun, a frame more held
    clock.push(card_chunk("s", 3, SIZE, SIZE))
    back = ticks(clock, 1, 10)[0]
    assert back.resumed and back.held is None and back.frame.chunk == 2 and clock.state is ClockState.PLAYING


def test_speech_running_dry_is_a_speech_underrun_and_resumes_on_the_next_chunk():
    clock = PlayoutClock(target_depth_chunks=2)
    for n in range(3):
        clock.push(card_chunk("s", n, SIZE, SIZE, speaking=True, turn_id=1))
    dry = ticks(clock, 13)[-1]
    assert dry.underrun is UnderrunCause.SPEECH and clock.resume_depth == 1
    clock.push(card_chunk("s", 3, SIZE, SIZE, speaking=True, turn_id=1))
    assert ticks(clock, 1, 13)[0].frame.chunk == 3  # no wait for the target depth


def test_placed_speech_holds_at_its_onset_frame_until_its_chunk_comes():
    clock = PlayoutClock(target_depth_chunks=1)
    for n in range(3):
        clock.push(card_chunk("s", n, SIZE, SIZE))
    ticks(clock, 1)  # chunk 0 on screen, at frame 1
    kept, dropped, last = clock.rollback(Onset(kept=0, chunk=1, onset=2, estimate=ESTIMATE), turn_start=True)
    assert [c.chunk for c in kept] == [1] and [c.chunk for c in dropped] == [2] and last == 0 and clock.epoch == 1
    before = ticks(clock, 5, 1)  # chunk 0's frames 1-3, then chunk 1's listening frames 0-1
    assert [(t.frame.chunk, t.frame.frame_in_chunk, t.frame.epoch) for t in before] == [
        (0, 1, 0), (0, 2, 0), (0, 3, 0), (1, 0, 0), (1, 1, 0)]
    hold = ticks(clock, 1, 6)[0]  # at the onset frame, the speech's chunk not there: an onset underrun
    assert hold.underrun is UnderrunCause.ONSET and hold.frame.chunk is None
    assert clock.state is ClockState.HOLDING_ONSET
    clock.push(card_chunk("s", 1, SIZE, SIZE, speaking=True, epoch=1, turn_id=4))
    onset, after = ticks(clock, 2, 7)
    assert (onset.frame.chunk, onset.frame.frame_in_chunk, onset.frame.epoch) == (1, 2, 1)
    assert onset.frame.speaking and onset.frame.first_speaking and not after.frame.first_speaking
    assert onset.frame.trace.stamps["playout_first_speaking_frame"] == 7.0
    assert clock.state is ClockState.PLAYING and not clock.speech_pending and clock.resume_depth == 2


def test_a_rollback_ends_a_hold_for_an_earlier_placement():
    clock = PlayoutClock(target_depth_chunks=1)
    for n in range(3):
        clock.push(card_chunk("s", n, SIZE, SIZE))
    ticks(clock, 1)
    kept, dropped, last = clock.rollback(Onset(kept=0, chunk=0, onset=2, estimate=ESTIMATE), turn_start=True)
    assert kept == [] and [c.chunk for c in dropped] == [1, 2] and last == -1  # onset in the chunk on screen
    assert [t.frame.chunk for t in ticks(clock, 2, 1)] == [0, None]  # its speech chunk 0 did not come
    assert clock.state is ClockState.HOLDING_ONSET
    clock.push(card_chunk("s", 1, SIZE, SIZE, speaking=True, epoch=1))  # the one after it does not take over
    assert ticks(clock, 1, 3)[0].frame.chunk is None
    kept, dropped, last = clock.rollback(None, turn_start=False)  # a barge-in: every unplayed chunk goes
    assert kept == [] and [c.chunk for c in dropped] == [1] and last == 0 and not clock.speech_pending
    resumed = ticks(clock, 1, 4)[0]  # the listening chunk plays on from the held frame
    assert clock.state is ClockState.PLAYING and (resumed.frame.chunk, resumed.frame.frame_in_chunk) == (0, 2)


def test_a_chunk_whose_rest_is_late_holds_at_its_last_frame_and_plays_on_when_it_comes():
    clock = PlayoutClock(target_depth_chunks=0)
    whole = card_chunk("s", 0, SIZE, SIZE, speaking=True, turn_id=1)
    clock.push(replace(whole, frames=whole.frames[:2]))  # the first part: 2 of 4 frames, all the audio
    shown, late, held = ticks(clock, 3)
    assert [(t.frame.chunk, t.frame.frame_in_chunk) for t in (shown, late)] == [(0, 0), (0, 1)]
    assert held.underrun is UnderrunCause.SPEECH and held.frame.chunk is None and clock.state is ClockState.WAITING
    assert (held.frame.image == late.frame.image).all() and not held.frame.audio.any()
    rest = replace(whole, frames=whole.frames[2:], audio=whole.audio[:0], offset=2)
    assert clock.extend(replace(rest, offset=3)) is None and clock.extend(replace(rest, epoch=1)) is None
    assert clock.extend(rest) is clock.playing
    on = ticks(clock, 2, 3)
    assert [(t.frame.chunk, t.frame.frame_in_chunk, t.underrun, t.resumed) for t in on] == [
        (0, 2, None, False), (0, 3, None, False)]
    assert (on[0].frame.image == whole.frames[2]).all() and clock.state is ClockState.PLAYING
    span = clock.timeline.samples_per_frame
    assert (on[1].frame.audio == whole.audio[3 * span:]).all()  # the first part's audio, at the rest's frames
    assert clock.extend(rest) is None  # played out: nothing to continue


def test_a_chunk_whose_rest_never_comes_ends_where_a_later_chunk_arrives():
    clock = PlayoutClock(target_depth_chunks=0)
    whole = card_chunk("s", 0, SIZE, SIZE)
    clock.push(replace(whole, frames=whole.frames[:2]))
    played = ticks(clock, 3)
    assert [t.frame.chunk for t in played] == [0, 0, None] and played[2].underrun is UnderrunCause.LISTENING
    clock.push(card_chunk("s", 1, SIZE, SIZE))  # parts come in order: chunk 0's rest was lost on the way
    on = ticks(clock, 4, 3)
    assert [(t.frame.chunk, t.frame.frame_in_chunk) for t in on] == [(1, 0), (1, 1), (1, 2), (1, 3)]
    assert clock.extend(replace(whole, frames=whole.frames[2:], audio=whole.audio[:0], offset=2)) is None
