"""Where a turn's speech starts: ``place_speech`` branch by branch, on a hand-built playhead.

The playhead: output frame 100 is the next released, due at its deadline ``now``; chunk 25 is on
screen (or none), chunks 26.. are buffered. Readiness is given in frames, half a frame short of a
whole one so the frame it reaches is exact: ``ready`` 2 means the chunk can make frame 102 (offset
2 from the next release); ``step`` and ``encode`` are in frames too.
"""

from __future__ import annotations

import pytest

from charstream.stages.playout.onset import Onset, Playhead, place_speech
from charstream.stages.playout.speech_estimate import Estimate
from charstream.timeline import VIDEO_FPS
from charstream.transport.messages import TurnStartPayload

NEXT_INDEX = 100
NOW = NEXT_INDEX / VIDEO_FPS  # the next frame's deadline (t0 = 0)
CASES = {
    # name: (ready, step, encode, on screen, position, buffered, earliest) -> (kept, chunk, onset)
    "within the chunk on screen": ((2, 0.5, 0, 25, 0, 3, None), (0, 25, 2)),
    "within it, past its first frames": ((1, 0.5, 0, 25, 1, 3, None), (0, 25, 2)),
    "in a buffered chunk, at a frame of it": ((6, 0.5, 0, 25, 0, 3, None), (0, 26, 2)),
    "two chunks in, the chunks before kept": ((11, 0.5, 0, 25, 0, 3, None), (1, 27, 3)),
    "ready before the next release: the next frame": ((-2, 0.0, 0, 25, 1, 3, None), (0, 25, 1)),
    "nothing on screen: from the first buffered": ((6, 0.5, 0, None, 0, 3, None), (1, 27, 2)),
    "the next chunk made a step later is due too early: later": ((2, 3, 0, 25, 0, 3, None), (0, 26, 0)),
    "the same for an encode longer than the step": ((2, 0.5, 3, 25, 0, 3, None), (0, 26, 0)),
    "an earliest chunk before the place binds nothing": ((2, 0.5, 0, 25, 0, 3, 24), (0, 25, 2)),
    "no earlier than the earliest chunk": ((2, 0.5, 0, 25, 0, 3, 27), (1, 27, 0)),
    "at the end of what is buffered, a chunk's first frame": ((16, 0.5, 0, 25, 0, 3, None), (3, 29, 0)),
    "into the chunk after the buffer: at its start": ((18, 0.5, 0, 25, 0, 3, None), (3, 29, 0)),
    "past the buffer: at its end, late whatever we do": ((30, 0.5, 0, 25, 0, 3, None), (3, 29, 0)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_place_speech(case):
    (ready, step, encode, on_screen, position, buffered, earliest), expected = CASES[case]
    ready_s, step_s = (ready - 0.5) / VIDEO_FPS, step / VIDEO_FPS
    estimate = Estimate(starts_s=ready_s - step_s, step_s=step_s, delivery_s=0.0, allowance_s=0.0)
    playhead = Playhead(t0=0.0, next_index=NEXT_INDEX, on_screen=on_screen, position=position, next_chunk=26,
                        buffered=buffered)
    turn_start = TurnStartPayload(earliest_chunk=earliest, last_emit_at=None, encode_s=encode / VIDEO_FPS)
    assert place_speech(estimate, turn_start, playhead, NOW) == Onset(*expected, estimate)
