"""Messages that travel between stages: plain dataclasses, one per edge kind.

Every message carries the session id, a chunk index or sequence number, and a trace context.
Arrays are numpy (tensors are converted at the stage boundary); the codec sends them as raw
multipart frames. Audio on the media timeline is 48 kHz mono int16; chunk ``n`` covers media
time ``[n * chunk_seconds, (n + 1) * chunk_seconds)`` of the session's ``Timeline``; the sizes below
(frames and samples per chunk) are the session's, checked by the stages that know it.

The ``Control`` kinds ``TURN_START``, ``ROLLBACK`` and ``CLOCK`` and the data messages' ``epoch``
carry the turn-start rollback: docs/ARCHITECTURE.md, Turn-start rollback.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np

from charstream.timeline import TIMELINE_RATE


@dataclass
class TraceContext:
    """Turn id plus wall-clock stamps (``time.time()`` seconds) keyed by trace point."""

    turn_id: int | None = None
    stamps: dict[str, float] = field(default_factory=dict)

    def stamp(self, point: str, at: float | None = None) -> TraceContext:
        self.stamps[point] = time.time() if at is None else at
        return self


@dataclass
class AgentAudio:
    """Agent speech after ingest: resampled onto the 48 kHz timeline.

    ``start_sample`` is the position of ``samples[0]`` on the session's media timeline.
    """

    session_id: str
    seq: int
    samples: np.ndarray  # int16, shape (n,)
    start_sample: int
    sample_rate: int = TIMELINE_RATE
    trace: TraceContext = field(default_factory=TraceContext)


class TurnKind(StrEnum):
    USER_SPEECH_START = "user_speech_start"
    USER_SPEECH_END = "user_speech_end"
    AGENT_TURN_START = "agent_turn_start"
    AGENT_TURN_END = "agent_turn_end"
    INTERRUPT = "interrupt"


@dataclass
class TurnEvent:
    session_id: str
    seq: int
    kind: TurnKind
    turn_id: int
    at: float  # wall clock of the event itself (e.g. back-dated end of user speech)
    trace: TraceContext = field(default_factory=TraceContext)


@dataclass
class Conditioning:
    """What diffusion needs for chunk ``chunk``: audio tokens, the speaking flag, the raw span."""

    session_id: str
    chunk: int
    audio_tokens: np.ndarray  # float32, (n_audio_tokens, audio_dim)
    audio: np.ndarray  # int16, (timeline.samples_per_chunk,) — the chunk's own span, carried to playout
    speaking: bool
    epoch: int = 0  # bumped by each rollback; data of an older epoch is stale
    trace: TraceContext = field(default_factory=TraceContext)
    # the chunk's first frame on the session's media timeline: chunk x frames_per_chunk, unless a turn start
    # re-phased a chunk-motion model's grid (RollbackPayload.start_frame); None: that product
    start_frame: int | None = None


@dataclass
class Latents:
    session_id: str
    chunk: int
    latents: np.ndarray  # float32 or float16, (C, h, w): one latent frame
    audio: np.ndarray  # int16, (timeline.samples_per_chunk,)
    speaking: bool
    epoch: int = 0  # bumped by each rollback; data of an older epoch is stale
    trace: TraceContext = field(default_factory=TraceContext)
    start_frame: int | None = None  # its Conditioning's


@dataclass
class VideoChunk:
    """A chunk's frames and audio; or a part of them: a chunk may come in parts, in order, the first with
    its first frames and all its audio, each later one (``offset`` > 0) with the frames from ``offset`` on
    and no audio (shape (0,)), until the chunk's ``timeline.frames_per_chunk`` frames are there."""

    session_id: str
    chunk: int
    frames: np.ndarray  # uint8, (frames, H, W, 3) RGB: the chunk's timeline.frames_per_chunk, or a part's
    audio: np.ndarray  # int16, (timeline.samples_per_chunk,) in a chunk's first part, (0,) in a later one
    speaking: bool
    epoch: int = 0  # bumped by each rollback; data of an older epoch is stale
    trace: TraceContext = field(default_factory=TraceContext)
    start_frame: int | None = None  # its Conditioning's: where playout restarts a re-phased grid from
    offset: int = 0  # the chunk's frame its first frame is


class ControlKind(StrEnum):
    INTERRUPT = "interrupt"  # barge-in: drop unplayed speech, return to listening
    TURN_START = "turn_start"  # conditioning -> playout: agent speech is ready to place; ``chunk``: the next one it would emit
    ROLLBACK = "rollback"  # playout -> all: last kept chunk in ``chunk``; the speech starts at the payload's onset frame of the next
    CLOCK = "clock"  # playout -> conditioning: chunk ``chunk`` is due at the payload's ``due_at`` (the pacing anchor)
    SHUTDOWN = "shutdown"
    ERROR = "error"  # a stage failed; the payload says which and why


def _require(ok: bool, problem: str) -> None:
    if not ok:
        raise ValueError(problem)


@dataclass(frozen=True)
class TurnStartPayload:
    """What playout places a turn's speech by (docs/ARCHITECTURE.md, Turn-start rollback)."""

    earliest_chunk: int | None  # the furthest chunk a rewind undoes exactly (None: any)
    last_emit_at: float | None  # wall clock of conditioning's last chunk: the step may still be busy with it
    encode_s: float  # the first speaking chunk is encoded once placed

    def __post_init__(self) -> None:
        _require(self.encode_s >= 0, f"encode_s must be >= 0, got {self.encode_s}")
        _require(self.last_emit_at is None or self.last_emit_at >= 0,
                 f"last_emit_at must be a wall clock >= 0, got {self.last_emit_at}")


@dataclass(frozen=True)
class RollbackPayload:
    """Where the speech starts after a rollback: frame ``onset_frame`` of chunk ``Control.chunk + 1``. A
    chunk-motion model (``start_frame`` set) restarts its chunk grid there instead: chunk ``Control.chunk + 1``
    is made anew from media frame ``start_frame`` on (the speech's first frame, after ``onset_frame`` frames
    of that chunk's listening version), each later chunk a whole chunk after it."""

    reason: ControlKind  # TURN_START or INTERRUPT
    onset_frame: int
    dropped: int  # unplayed chunks dropped
    kept: int  # unplayed chunks kept to play before the speech
    placed_at: float | None = None  # wall clock of a speech placement (conditioning logs the control's hop)
    due_at: float | None = None  # wall clock at which chunk ``Control.chunk + 1`` is due (a placement's)
    start_frame: int | None = None  # a chunk-motion model's restart: chunk ``Control.chunk + 1``'s first media frame

    def __post_init__(self) -> None:
        _require(self.reason in (ControlKind.TURN_START, ControlKind.INTERRUPT),
                 f"reason must be turn_start or interrupt, got {self.reason}")
        # within a chunk of the session's timeline: its stages check the upper bound
        _require(self.onset_frame >= 0, f"onset_frame must be >= 0, got {self.onset_frame}")
        _require(self.start_frame is None or self.start_frame >= 0, f"start_frame must be >= 0, got {self.start_frame}")
        _require(self.dropped >= 0 and self.kept >= 0, f"dropped and kept must be >= 0, got {self.dropped}, {self.kept}")
        for name in ("placed_at", "due_at"):
            value = getattr(self, name)
            _require(value is None or value >= 0, f"{name} must be a wall clock >= 0, got {value}")


@dataclass(frozen=True)
class ClockPayload:
    due_at: float  # wall clock at which chunk ``Control.chunk`` is due at playout

    def __post_init__(self) -> None:
        _require(self.due_at >= 0, f"due_at must be a wall clock >= 0, got {self.due_at}")


@dataclass(frozen=True)
class InterruptPayload:
    at_sample: int  # media time of the barge-in (the turn is in ``Control.trace``)

    def __post_init__(self) -> None:
        _require(self.at_sample >= 0, f"at_sample must be >= 0, got {self.at_sample}")


@dataclass(frozen=True)
class ErrorPayload:
    stage: str  # the stage that failed
    error: str  # why

    def __post_init__(self) -> None:
        _require(bool(self.stage), "stage must not be empty")


@dataclass(frozen=True)
class ShutdownPayload:
    reason: str  # what ended the session


ControlPayload = TurnStartPayload | RollbackPayload | ClockPayload | InterruptPayload | ErrorPayload | ShutdownPayload
CONTROL_PAYLOADS: dict[ControlKind, type] = {
    ControlKind.TURN_START: TurnStartPayload, ControlKind.ROLLBACK: RollbackPayload, ControlKind.CLOCK: ClockPayload,
    ControlKind.INTERRUPT: InterruptPayload, ControlKind.ERROR: ErrorPayload, ControlKind.SHUTDOWN: ShutdownPayload,
}


@dataclass
class Control:
    """Control messages travel on their own channel and overtake data. ``payload``: the kind's own
    (``CONTROL_PAYLOADS``) or None (a bare control: a turn start with nothing to place by, say)."""

    session_id: str
    seq: int
    kind: ControlKind
    chunk: int | None = None
    epoch: int = 0
    payload: ControlPayload | None = None
    trace: TraceContext = field(default_factory=TraceContext)

    def __post_init__(self) -> None:
        expected = CONTROL_PAYLOADS[self.kind]
        _require(self.payload is None or type(self.payload) is expected,
                 f"a {self.kind} control carries a {expected.__name__}, got {type(self.payload).__name__}")


Message = AgentAudio | TurnEvent | Conditioning | Latents | VideoChunk | Control
MESSAGE_TYPES: tuple[type, ...] = (AgentAudio, TurnEvent, Conditioning, Latents, VideoChunk, Control)
