"""When a turn's first speech chunk reaches playout: an estimate from that chunk's own production.

Playout places a turn's speech at the first frame its first chunk can reach (docs/ARCHITECTURE.md,
Turn-start rollback; why this rule: docs/decisions/0013-speech-placement-estimate.md). Every chunk
carries ``conditioning_ready`` and ``diffusion_done`` stamps, so playout measures the two parts of
each chunk's production after conditioning:

- step: ``conditioning_ready`` -> ``diffusion_done`` (the hop to diffusion and the step itself), from
  the chunk before's ``diffusion_done`` where that is later: a chunk queued behind another's step (a
  session's first chunks go in a burst) measures its own step, not the queue -- the queue a speech
  chunk meets is ``last_emit_at``'s part of the estimate; for a chunk-motion model, whose chunk starts
  only once the chunk before is decoded (``waits_for_decode``), from that chunk's ``decode_done`` where later
  (of a chunk decoded in parts, its last part's ``decode_rest_done``: ``decoded``): a listening chunk waits
  for it, the speech's first chunk, made after a rollback, does not;
- delivery: ``diffusion_done`` -> its arrival at playout (the hop to decode, decode, the hop here).

The estimate, in seconds from now::

    starts = max(encode_s, last_emit_at + step - now)   # its step starts: encoded, the busy step done
    ready = starts + step + delivery + allowance

``step`` and ``delivery`` are the nearest-rank ``QUANTILE`` (90th percentile) of the last ``HISTORY``
chunks, so a chunk that waited in a queue or met a GC pause sets no estimate on its own. The session's
first chunk is not among them: it pays the session's one-off costs (a FlashHead Pro session's first
decode took 2.4 s on an H100 where the next ones took 0.1 s, and with five chunks measured before the
first turn the 90th percentile was that one).

The allowance is the larger of two. Learned: the second latest of the last ``ERROR_HISTORY`` speech
chunks' errors (the latest while they span one turn), >= 0 -- a jitter buffer's rule, so one stall in
256 chunks sets nothing. A chunk's error is its arrival against the schedule the placement set without
allowance (the first chunk at the estimate, chunk ``k`` ``k`` chunks later less the onset frames: at a
real-time agent pace each leaves conditioning a chunk after the one before), so the allowance does not
feed itself. The first measured turn's errors set the second turn's allowance and are then forgotten
(they ran beside the session's warm-up). The prior: ``PlayoutConfig.initial_allowance_s`` (one chunk),
the whole allowance until a turn has been measured, halved with each measured turn and gone after
``PRIOR_TURNS`` -- a few turns' errors do not yet speak for the tail.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

QUANTILE = 0.9  # of the recent chunks' step and delivery times
HISTORY = 48  # chunks the quantiles are taken over (8 s of tiny's, 54 s of FlashHead Pro's)
ERROR_HISTORY = 256  # speech chunks (~8 turns) whose second latest error against its schedule is the allowance
PRIOR_TURNS = 6  # measured turns after which the errors alone set the allowance (the prior halves each turn)
MAX_TURN_CHUNKS = 256  # errors kept per turn for its log line (bounded; a turn of ~43 s)


def nearest_rank(values: list[float] | deque[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def prior_allowance(initial_s: float, turns_measured: int) -> float:
    """The prior's share of the allowance after ``turns_measured`` measured turns: halved with each,
    none after ``PRIOR_TURNS``."""
    return initial_s / 2 ** turns_measured if turns_measured < PRIOR_TURNS else 0.0


@dataclass(frozen=True)
class Estimate:
    """When the first speech chunk is expected, in seconds from when it was estimated."""

    starts_s: float  # its step can start (encoded, the busy step done)
    step_s: float  # the step part (quantile)
    delivery_s: float  # the delivery part (quantile)
    allowance_s: float  # learned from recent turns' errors, or the prior while it is larger

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


class SpeechEstimator:
    """The measured parts of recent chunks' production, and the allowance learned from turn starts."""

    def __init__(self, quantile: float = QUANTILE, history: int = HISTORY, error_history: int = ERROR_HISTORY,
                 *, initial_allowance_s: float, waits_for_decode: bool = False) -> None:
        """``initial_allowance_s``: the prior, the whole allowance until a turn has been measured
        (``PlayoutConfig.initial_allowance_s``); ``waits_for_decode``: a chunk's step starts once the chunk
        before is decoded (a chunk-motion model)."""
        if not 0 < quantile <= 1 or history < 1 or error_history < 2 or initial_allowance_s < 0:
            raise ValueError(f"speech estimate: need 0 < quantile <= 1, history >= 1, error history >= 2, an "
                             f"initial allowance >= 0; got {quantile}, {history}, {error_history}, {initial_allowance_s}")
        self.quantile = quantile
        self._step: deque[float] = deque(maxlen=history)
        self._delivery: deque[float] = deque(maxlen=history)
        self.waits_for_decode = waits_for_decode
        self._free_at: float | None = None  # when the last observed chunk let the next one's step start
        self.initial_allowance_s = initial_allowance_s
        self.turns_measured = 0
        self._learned_s = 0.0  # from the errors
        self._errors: deque[float] = deque(maxlen=error_history)  # recent speech chunks', across turns
        self._turn: list[float] = []  # errors of the current turn's chunks, its first chunk's first

    @property
    def prior_s(self) -> float:
        return prior_allowance(self.initial_allowance_s, self.turns_measured)

    @property
    def allowance_s(self) -> float:
        return max(self._learned_s, self.prior_s)

    @property
    def measured(self) -> bool:
        return bool(self._step) and bool(self._delivery)

    def observe(self, stamps: dict[str, float], arrived_at: float) -> tuple[float, float] | None:
        """Record a chunk's parts from its stamps (wall clock) and its arrival here; its (step, delivery)
        in seconds, None without the stamps."""
        ready, done = stamps.get("conditioning_ready"), stamps.get("diffusion_done")
        if ready is None or done is None:
            return None
        first = self._free_at is None  # the session's first chunk: measured, not counted (module docstring)
        step, delivery = done - (ready if first else max(ready, self._free_at)), arrived_at - done
        if not first:
            self._step.append(step)
            self._delivery.append(delivery)
        self._free_at = stamps.get("decode_done", done) if self.waits_for_decode else done
        return step, delivery

    def decoded(self, stamps: dict[str, float]) -> None:
        """The last part of a chunk that came in parts arrived: the next chunk's step starts from its end."""
        if self.waits_for_decode and "decode_rest_done" in stamps:
            self._free_at = stamps["decode_rest_done"]

    def step_s(self) -> float:
        return nearest_rank(self._step, self.quantile)

    def estimate(self, now: float, encode_s: float, last_emit_at: float | None) -> Estimate:
        """The first speech chunk's arrival, estimated at wall clock ``now``."""
        step = self.step_s()
        starts = encode_s if last_emit_at is None else max(encode_s, last_emit_at + step - now)
        return Estimate(starts, step, nearest_rank(self._delivery, self.quantile), self.allowance_s)

    def speech_arrived(self, error_s: float) -> None:
        """A chunk of the current turn's speech arrived ``error_s`` after its estimated schedule."""
        self._errors.append(error_s)
        if len(self._turn) < MAX_TURN_CHUNKS:
            self._turn.append(error_s)

    def end_turn(self) -> TurnError | None:
        """The current turn's errors (None: none of its speech arrived); the allowance from the recent
        chunks' errors, this turn's included."""
        errors, self._turn = self._turn, []
        if not errors:
            return None
        # One stall sets nothing -- once the history spans two turns: before, the latest error counts (at
        # an agent pace ahead of real time a turn's later chunks come early, and the second latest of one
        # turn's errors would pass over its first chunk's, the one the placement is for).
        spans_turns = len(self._errors) > len(errors)
        self._learned_s = max(0.0, sorted(self._errors)[-2 if spans_turns else -1])
        if not self.turns_measured:  # the session's first measured turn (its warm-up): for the next turn only
            self._errors.clear()
        self.turns_measured += 1
        return TurnError(len(errors), errors[0], nearest_rank(errors, QUANTILE), max(errors))
