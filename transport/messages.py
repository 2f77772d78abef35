"""Messages that travel between stages: plain dataclasses, one per edge kind.

Every message carries the session id, a chunk index or sequence number, and a trace context.
Arrays are numpy (tensors are converted at the stage boundary); the codec sends them as raw
multipart frames. Audio on the media timeline is 48 kHz mono int16; chunk ``n`` covers media
time ``[n * CHUNK_SECONDS, (n + 1) * CHUNK_SECONDS)``.

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
    audio: np.ndarray  # int16, (SAMPLES_PER_CHUNK,) — the chunk's own span, carried to playout
    speaking: bool
    epoch: int = 0  # bumped by each rollback; data of an older epoch is stale
    trace: TraceContext = field(default_factory=TraceContext)


@dataclass
class Latents:
    session_id: str
    chunk: int
    latents: np.ndarray  # float32 or float16, (C, h, w): one latent frame
    audio: np.ndarray  # int16, (SAMPLES_PER_CHUNK,)
    speaking: bool
    epoch: int = 0  # bumped by each rollback; data of an older epoch is stale
    trace: TraceContext = field(default_factory=TraceContext)


@dataclass
class VideoChunk:
    session_id: str
    chunk: int
    frames: np.ndarray  # uint8, (FRAMES_PER_CHUNK, H, W, 3) RGB
    audio: np.ndarray  # int16, (SAMPLES_PER_CHUNK,)
    speaking: bool
    epoch: int = 0  # bumped by each rollback; data of an older epoch is stale
    trace: TraceContext = field(default_factory=TraceContext)


class ControlKind(StrEnum):
    INTERRUPT = "interrupt"  # barge-in: drop unplayed speech, return to listening
    TURN_START = "turn_start"  # conditioning -> playout: agent speech is ready to place; ``chunk``: the next one it would emit
    ROLLBACK = "rollback"  # playout -> all: last kept chunk in ``chunk``; the speech starts at ``detail['onset_frame']`` of the next
    CLOCK = "clock"  # playout -> conditioning: chunk ``chunk`` is due at wall clock ``detail['due_at']`` (the pacing anchor)
    SHUTDOWN = "shutdown"
    ERROR = "error"  # a stage failed; ``detail['stage']`` and ``detail['error']`` say which and why


@dataclass
class Control:
    """Control messages travel on their own channel and overtake data."""

    session_id: str
    seq: int
    kind: ControlKind
    chunk: int | None = None
    epoch: int = 0
    detail: dict[str, str | int | float | bool | None] = field(default_factory=dict)
    trace: TraceContext = field(default_factory=TraceContext)


Message = AgentAudio | TurnEvent | Conditioning | Latents | VideoChunk | Control
MESSAGE_TYPES: tuple[type, ...] = (AgentAudio, TurnEvent, Conditioning, Latents, VideoChunk, Control)
