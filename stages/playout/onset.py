"""Where a turn's speech starts on the output timeline (docs/ARCHITECTURE.md, Turn-start rollback).

A pure function of the estimate, where playout stands and the turn start's payload.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from charstream.stages.playout.speech_estimate import Estimate
from charstream.timeline import CHARACTERS, Timeline
from charstream.transport.messages import TurnStartPayload


@dataclass(frozen=True)
class Playhead:
    """Where playout stands when a turn starts."""

    t0: float  # monotonic deadline of output frame 0
    next_index: int  # the next output frame to release
    on_screen: int | None  # the chunk playing (None: none)
    position: int  # its next frame
    next_chunk: int  # the chunk after it (the first buffered one while none plays)
    buffered: int  # unplayed chunks, consecutive from ``next_chunk``
    timeline: Timeline = CHARACTERS  # the session's: frames per chunk, fps

    @property
    def frames_left(self) -> int:
        """Frames of the chunk on screen not released yet."""
        return self.timeline.frames_per_chunk - self.position if self.on_screen is not None else 0


@dataclass(frozen=True)
class Onset:
    """Where a turn's speech starts: frame ``onset`` of chunk ``chunk``, after ``kept`` unplayed chunks
    (the frames of ``chunk`` before the onset are its listening version, already made)."""

    kept: int
    chunk: int
    onset: int
    estimate: Estimate  # what it was placed by: when the speech's first chunk arrives


def place_speech(estimate: Estimate, turn_start: TurnStartPayload, playhead: Playhead, now: float,
                 rephase: bool = False) -> Onset:
    """The first frame the speech's first chunk, ready ``estimate.ready_s`` after ``now`` (monotonic),
    reaches in time, whose next chunk (made one step or encode later) is not due before it is there;
    no earlier than ``turn_start.earliest_chunk``, and no later than the end of what is buffered.
    ``rephase``: the speech's chunks start at the onset frame (a chunk-motion model makes a whole chunk
    from any frame, continuing the frames shown before it), so its next chunk is due a whole chunk after
    the onset, not at the boundary after it."""
    t0, left = playhead.t0, playhead.frames_left
    fps, n = playhead.timeline.fps, playhead.timeline.frames_per_chunk
    ready_at = now + estimate.ready_s
    ahead = max(0, math.ceil((ready_at - t0) * fps) - playhead.next_index)  # frames from the next release
    next_needed = ready_at + max(estimate.step_s, turn_start.encode_s)
    while t0 + (playhead.next_index + (ahead + n if rephase else _next_boundary(ahead, left, n))) / fps < next_needed:
        ahead += 1
    first = playhead.next_chunk
    if ahead < left:  # within the chunk on screen
        assert playhead.on_screen is not None
        place = Onset(0, playhead.on_screen, playhead.position + ahead, estimate)
    else:
        kept, onset = divmod(ahead - left, n)
        place = Onset(kept, first + kept, onset, estimate)
    earliest = turn_start.earliest_chunk
    if earliest is not None and place.chunk < earliest:  # a rewind that far would not be exact
        place = Onset(earliest - first, earliest, 0, estimate)
    if place.kept > playhead.buffered or (place.kept == playhead.buffered and place.onset):
        # not enough made ahead: the speech will be late whatever we do
        place = Onset(playhead.buffered, first + playhead.buffered, 0, estimate)
    return place


def _next_boundary(offset: int, left: int, frames_per_chunk: int) -> int:
    """Frames from the next release to the start of the chunk after the one holding frame ``offset``
    (``left``: frames left in the chunk on screen)."""
    return left if offset < left else left + frames_per_chunk * ((offset - left) // frames_per_chunk + 1)
