"""The media timeline: one clock for every stage (docs/ARCHITECTURE.md, Media timeline).

Video runs at 24 fps; a chunk is 4 frames = one latent frame = one diffusion step; audio on the
timeline is 48 kHz mono int16. Chunk ``n`` covers media time ``[n * CHUNK_SECONDS, (n + 1) * CHUNK_SECONDS)``.
This module sits below every layer: anything may import it, it imports nothing of the project.
"""

VIDEO_FPS = 24
FRAMES_PER_CHUNK = 4
TIMELINE_RATE = 48_000
SAMPLES_PER_FRAME = TIMELINE_RATE // VIDEO_FPS  # 2,000
SAMPLES_PER_CHUNK = SAMPLES_PER_FRAME * FRAMES_PER_CHUNK  # 8,000
CHUNK_SECONDS = FRAMES_PER_CHUNK / VIDEO_FPS  # 0.1667 s

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
