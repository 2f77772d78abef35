"""When a turn's first speech chunk reaches playout: an estimate from that chunk's own production.

Playout places a turn's speech at the first frame its first chunk can reach (docs/ARCHITECTURE.md,
Turn-start rollback). That chunk is made after the rollback: conditioning encodes it (``encode_s``),
its diffusion step starts once the step still busy with the last listening chunk is done, then it is
decoded and delivered. Every chunk carries ``conditioning_ready`` and ``diffusion_done`` stamps, so
playout measures the two parts of each chunk's production after conditioning:

- step: ``conditioning_ready`` -> ``diffusion_done`` (the hop to diffusion and the step itself);
- delivery: ``diffusion_done`` -> its arrival at playout (the hop to decode, decode, the hop here).

The estimate, in seconds from now::

    starts = max(encode_s, last_emit_at + step - now)   # its step starts: encoded, the busy step done
    ready = starts + step + delivery + allowance

``step`` and ``delivery`` are the nearest-rank ``QUANTILE`` (90th percentile) of the last ``HISTORY``
chunks: a chunk that waited in a queue (a speech chunk behind backpressure) or met a GC pause sets
no estimate on its own, as the maximum of the whole chunk's latency did.

The allowance is learned from what the speech of recent turns took beyond its estimate: the first
chunk's error (arrival - the estimate without allowance) and, for the chunks after it, their arrival
against the schedule the placement set (chunk ``k`` due ``k`` chunks after the first, less its onset
frames): at a real-time agent pace every chunk of a turn leaves conditioning a chunk after the one
before, so each must fit the same budget. A turn's error is the largest of its chunks' (the first
included): a chunk later than its schedule by more than the slack of its frame is a held frame, and
on a quiet 2-core VM the chunks beyond the 90th percentile ran 2-19 ms behind it turn after turn
(docs/PERF.md, "Hours of use"), so an allowance from the 90th percentile left those frames held.
The allowance is the last turn's error (>= 0) or ``DECAY`` times the allowance before, whichever is
larger: one slow chunk taxes the next turns less and less. Until a
turn has been measured it is ``PlayoutConfig.first_turn_allowance_s`` (one chunk: a session's first
turn ran a chunk 58-155 ms behind its schedule in quiet CPU runs and on the H200, docs/PERF.md), a
guess that the first measured turn replaces (it is not decayed into later turns).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

QUANTILE = 0.9  # of the recent chunks' step and delivery times
HISTORY = 48  # chunks (8 s) the quantiles are taken over
DECAY = 0.5  # per turn: what an earlier turn's error still adds to the allowance
MAX_TURN_CHUNKS = 256  # errors kept per turn (bounded; a turn of ~43 s)


def nearest_rank(values: list[float] | deque[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


@dataclass(frozen=True)
class Estimate:
    """When the first speech chunk is expected, in seconds from when it was estimated."""

    starts_s: float  # its step can start (encoded, the busy step done)
    step_s: float  # the step part (quantile)
    delivery_s: float  # the delivery part (quantile)
    allowance_s: float  # learned from recent turns' errors

    @property
    def expected_s(self) -> float:
        """The arrival the measured parts predict (the allowance not included)."""
        return self.starts_s + self.step_s + self.delivery_s

    @property
    def ready_s(self) -> float:
        """The arrival the speech is placed for."""
        return self.expected_s + self.allowance_s

    def fields(self) -> dict[str, float]:
        """For the placement's log line, in ms."""
        return {name: round(value * 1e3, 1) for name, value in (
            ("ready_in_ms", self.ready_s), ("starts_in_ms", self.starts_s), ("step_ms", self.step_s),
            ("delivery_ms", self.delivery_s), ("allowance_ms", self.allowance_s))}


@dataclass(frozen=True)
class TurnError:
    """What a turn's speech took beyond its estimate (seconds; > 0: later than estimated)."""

    chunks: int
    first_s: float
    p90_s: float
    max_s: float

    @property
    def error_s(self) -> float:
        return max(0.0, self.max_s)


class SpeechEstimator:
    """The measured parts of recent chunks' production, and the allowance learned from turn starts."""

    def __init__(self, quantile: float = QUANTILE, history: int = HISTORY, decay: float = DECAY,
                 *, initial_allowance_s: float) -> None:
        """``initial_allowance_s``: the allowance until a turn has been measured
        (``PlayoutConfig.first_turn_allowance_s``)."""
        if not 0 < quantile <= 1 or history < 1 or not 0 <= decay < 1 or initial_allowance_s < 0:
            raise ValueError(f"speech estimate: need 0 < quantile <= 1, history >= 1, 0 <= decay < 1, an initial "
                             f"allowance >= 0; got {quantile}, {history}, {decay}, {initial_allowance_s}")
        self.quantile, self.decay = quantile, decay
        self._step: deque[float] = deque(maxlen=history)
        self._delivery: deque[float] = deque(maxlen=history)
        self.allowance_s = initial_allowance_s
        self._turn: list[float] = []  # errors of the current turn's chunks, its first chunk's first
        self._learned = False  # a turn has been measured (the initial allowance is a guess, not decayed)

    @property
    def measured(self) -> bool:
        return bool(self._step) and bool(self._delivery)

    def observe(self, stamps: dict[str, float], arrived_at: float) -> None:
        """Record a chunk's parts from its stamps (wall clock) and its arrival here."""
        ready, done = stamps.get("conditioning_ready"), stamps.get("diffusion_done")
        if ready is None or done is None:
            return
        self._step.append(done - ready)
        self._delivery.append(arrived_at - done)

    def step_s(self) -> float:
        return nearest_rank(self._step, self.quantile)

    def estimate(self, now: float, encode_s: float, last_emit_at: float | None) -> Estimate:
        """The first speech chunk's arrival, estimated at wall clock ``now``."""
        step = self.step_s()
        starts = encode_s if last_emit_at is None else max(encode_s, last_emit_at + step - now)
        return Estimate(starts, step, nearest_rank(self._delivery, self.quantile), self.allowance_s)

    def speech_arrived(self, error_s: float) -> None:
        """A chunk of the current turn's speech arrived ``error_s`` after its estimated schedule."""
        if len(self._turn) < MAX_TURN_CHUNKS:
            self._turn.append(error_s)

    def end_turn(self) -> TurnError | None:
        """Fold the current turn's errors into the allowance (None: none of its speech arrived)."""
        errors, self._turn = self._turn, []
        if not errors:
            return None
        turn = TurnError(len(errors), errors[0], nearest_rank(errors, self.quantile), max(errors))
        self.allowance_s = max(turn.error_s, self.decay * self.allowance_s if self._learned else 0.0)
        self._learned = True
        return turn
