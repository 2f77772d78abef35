"""The media timeline: one clock per session, set by its model (docs/ARCHITECTURE.md, Media timeline).

A ``Timeline`` says how fast video runs (``fps``), how many new frames one chunk adds to the stream
(``frames_per_chunk``) and the audio rate on the timeline (48 kHz mono int16 for every model: WebRTC's
Opus runs at 48 kHz; agent audio at any rate is resampled on ingest). Chunk ``n`` covers media time
``[n * chunk_seconds, (n + 1) * chunk_seconds)`` and carries ``samples_per_chunk`` samples of audio, so
A/V sync is by construction. ``CHARACTERS`` is the characters family's (24 fps, 4 frames = one latent
frame = one diffusion step); another family brings its own (SoulX-FlashHead: 25 fps, 28 new frames).
Every stage, the trace and egress read the session's timeline, never a module constant.

This module sits below every layer: anything may import it, it imports nothing of the project.
"""

from __future__ import annotations

from dataclasses import dataclass

TIMELINE_RATE = 48_000  # audio on every session's timeline (Hz); the one rate WebRTC's Opus sends


def ms_samples(ms: float) -> int:
    """``ms`` milliseconds of the timeline, in samples (nearest)."""
    return int(round(ms * TIMELINE_RATE / 1000))


@dataclass(frozen=True)
class Timeline:
    fps: int
    frames_per_chunk: int  # new frames each chunk adds to the stream
    rate: int = TIMELINE_RATE

    def __post_init__(self) -> None:
        if self.fps <= 0 or self.frames_per_chunk <= 0:
            raise ValueError(f"timeline: fps and frames_per_chunk must be > 0, got {self.fps}, {self.frames_per_chunk}")
        # a frame that does not hold a whole number of samples would drift audio against video
        if self.rate % self.fps:
            raise ValueError(f"timeline: {self.rate} Hz audio is not a whole number of samples per frame at {self.fps} fps")

    @property
    def samples_per_frame(self) -> int:
        return self.rate // self.fps

    @property
    def samples_per_chunk(self) -> int:
        return self.samples_per_frame * self.frames_per_chunk

    @property
    def chunk_seconds(self) -> float:
        return self.frames_per_chunk / self.fps

    @property
    def frame_seconds(self) -> float:
        return 1.0 / self.fps


CHARACTERS = Timeline(fps=24, frames_per_chunk=4)  # 2,000 samples per frame, 8,000 per chunk, 166.67 ms

# The trace contract, in order (docs/ARCHITECTURE.md, Tracing).
TRACE_POINTS = (
    "user_speech_end",
    "agent_first_audio",
    "conditioning_ready",
    "diffusion_done",
    "decode_done",
    "playout_first_speaking_frame",
    "client_first_speaking_frame",
)
