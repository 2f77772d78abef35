"""Each stage's typed config section; ``charstream.pipeline.config.PipelineConfig`` composes them.

Every field has the one default that runs the embedded CPU demo: a stage is built from its section
and reads no other default.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from charstream.model.step.options import StepOptions

AGENT_PACES = ("realtime", "synthesized")  # IngestConfig.agent_pace
RECOGNIZERS = ("whisper", "pocketsphinx-domain", "pocketsphinx-general")  # IngestConfig.recognizer


@dataclass
class IngestConfig:
    adapter: str = "listening"  # listening (the built-in agent: hears the mic) | scripted | zmq | pipecat | livekit
    # built-in agent's speech recogniser: whisper (tiny.en, offline) | pocketsphinx-domain (the conversation's
    # trigram) | pocketsphinx-general (stages/agents/asr.py; pipeline/bench/asr.py measures them)
    recognizer: str = "whisper"
    think_delay_s: float = 0.4  # stands for STT + LLM in the scripted agent
    user_voice: str = "en-us"
    agent_voice: str = "en+f3"
    vad_threshold: float = 0.5
    vad_silence_ms: int = 300  # end of speech is back-dated by this window
    vad_start_ms: int = 64  # speech this long (consecutive 32 ms windows) starts a user turn / barge-in
    max_ahead_s: float = 0.25  # agent audio is emitted at most this far ahead of the media clock
    playout_tail_s: float = 1.0  # user speech this long after the agent's audio ended still barges in (pipeline latency)
    zmq_endpoint: str = "tcp://127.0.0.1:5790"
    zmq_dead_after_s: float = 1.5  # an external agent silent this long (no audio, no ping) is gone
    zmq_curve_secret_key: str | None = None  # Z85 CURVE secret of the agent socket; required off loopback
    zmq_curve_agents: list[str] = field(default_factory=list)  # Z85 public keys of the agents let in (with CURVE)
    script: list[dict] | None = None  # scripted agent: [{"user", "agent", "barge_in_after_s"?}]; None = built-in
    lead_in_s: float = 0.5  # scripted agent: silence before the user's first line
    turn_gap_s: float = 1.5  # scripted agent: silence after a reply before the next line (> playout_tail_s)
    # scripted agent's reply: "realtime" (one 20 ms frame per 20 ms) | "synthesized" (as a TTS service
    # pushes it: what is synthesised -- espeak makes the whole line at once -- up to max_ahead_s ahead)
    agent_pace: str = "realtime"
    # scripted agent: its user's speech also goes through the built-in recogniser (``recognizer``), so each
    # turn says what was heard; off, turns carry no "heard" (a capacity run: a real agent's STT runs elsewhere)
    scripted_recognizer: bool = True

    def __post_init__(self) -> None:
        if self.recognizer not in RECOGNIZERS:
            raise ValueError(f"ingest.recognizer: one of {', '.join(RECOGNIZERS)}, got {self.recognizer!r}")
        # a threshold silero's probability never passes makes the character deaf, without an error
        if not 0 < self.vad_threshold < 1:
            raise ValueError(f"ingest.vad_threshold: a speech probability in (0, 1), got {self.vad_threshold}")
        if self.vad_silence_ms <= 0 or self.vad_start_ms <= 0:
            raise ValueError(f"ingest.vad_silence_ms and vad_start_ms must be > 0, got {self.vad_silence_ms}, "
                             f"{self.vad_start_ms}")


@dataclass
class ConditioningConfig:
    device: str = "cpu"  # the audio encoder's (pipeline/runtime/layouts.py: the decoder's GPU, beside the edge's CPU work)
    graphed: bool = True  # on CUDA: a chunk's encode as one CUDA graph replay (model/graphed_audio_encoder.py)
    idle_lead_chunks: int | None = 4  # listening chunks are emitted at most this far ahead of real time
    rollback_wait_s: float = 0.5  # no ROLLBACK answer to a TURN_START this long: place the speech anyway
    stall_s: float = 1.0  # a speaking turn whose agent sends nothing this long is ended


@dataclass
class DiffusionConfig:
    tp: int = 1
    device: str = "cpu"  # rank 0's device; ranks 1.. use ``devices`` (pipeline/runtime/layouts.py fills both)
    devices: list[str] = field(default_factory=list)  # one per TP rank; empty = ``device`` for every rank
    seed: int = 0
    fp8_cache: bool | None = None  # FP8 e4m3 ring; None: on CUDA devices (the CPU keeps the model's dtype)
    threads: int | None = None  # CPU intra-op threads; None: half the cores (decode runs beside it)
    # every rank's step: fused body, CUDA graphs, the full window's attention (model/step/options.py)
    step: StepOptions = field(default_factory=StepOptions)
    # > 1: the sessions of one serving process share one model and batch their due steps into one
    # forward of up to this many (stages/diffusion/batcher.py; the module body, CUDA-graphed per batch size)
    batch_sessions: int = 1
    batch_window_s: float = 0.01  # a forward waits at most this long after its first step for the others

    def fp8_ring(self) -> bool:
        """Whether the KV ring holds FP8: ``fp8_cache``, or when None, on a CUDA device."""
        return self.device.startswith("cuda") if self.fp8_cache is None else self.fp8_cache


@dataclass
class DecodeConfig:
    device: str = "cpu"
    graphed: bool = True  # on CUDA: the decoder as one CUDA graph per chunk (model/graphed_decoder.py)
    threads: int | None = None  # CPU intra-op threads; None: half the cores (diffusion runs beside it)
    # > 1: the sessions of one serving process share one decoder and decode their due chunks in one
    # forward of up to this many (stages/decode/batcher.py; CUDA-graphed per batch size); decode then
    # runs in the serving process
    batch_sessions: int = 1
    batch_window_s: float = 0.01  # a forward waits at most this long after its first chunk for the others


@dataclass
class PlayoutConfig:
    target_depth_chunks: int = 2  # chunks queued behind the playing one: absorbs a stall of this many chunks
    max_depth_chunks: int = 8  # a full buffer withholds credit from decode (backpressure)
    history_frames: int = 48  # released frames (pixels + audio) kept for egress readers that start late
    # What the speech placement allows beyond its estimate until a turn has been measured, then halved with
    # each measured turn while the allowance learned from the turns' errors takes over (stages/playout/speech_estimate.py):
    # one chunk -- a session's first turn ran a chunk 58-155 ms behind its schedule (docs/PERF.md);
    # None: one chunk of the session's timeline
    initial_allowance_s: float | None = None


def check_port(port: int | None, name: str = "") -> None:
    """A TCP port a listener binds (None: none): 0-65535, 0 picking a free one."""
    if port is not None and not 0 <= port <= 65535:
        raise ValueError(f"{name + ': ' if name else ''}{port} is not a TCP port (0-65535; 0 picks a free one)")


@dataclass
class EgressConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    codec: str = "VP8"  # VP8 | H264
    max_sessions: int = 16
    offer_timeout_s: float = 30.0  # a reserved session with no offer by then is released
    ice_servers: list[str] = field(default_factory=list)  # STUN/TURN URLs; none on loopback/LAN (never a public default)
    ping_interval_s: float = 1.0  # data-channel ping: clock offset estimate + liveness
    client_timeout_s: float = 10.0  # no pong this long: the client vanished, its session is closed
    # 20 ms mic frames held for ingest before the oldest is dropped: 10 s, so the user's first words,
    # spoken while the session's stages still load (seconds on a CPU), wait instead of being lost
    user_audio_queue_frames: int = 500
    # Host header names served besides IP literals, "localhost" and `host` (a DNS-rebinding page
    # sends its own name): add the names a LAN or proxy setup reaches this server by.
    allowed_hosts: list[str] = field(default_factory=list)
    idle_timeout_s: float = 10.0  # a connection without a complete request for this long is closed
    body_timeout_s: float = 10.0  # a request body must arrive within this
    reservations_per_client: int = 2  # reserved sessions still waiting for their offer, per client address
    reservations_per_minute: int = 20  # new reservations per client address and minute (renewals count)
    memory_trim_s: float = 30.0  # the serving process returns glibc's free memory to the OS this often (0: never)

    def __post_init__(self) -> None:
        check_port(self.port, "egress.port")
        if self.max_sessions < 1:  # would refuse every connection
            raise ValueError(f"egress.max_sessions must be >= 1, got {self.max_sessions}")


@dataclass
class TracingConfig:
    jsonl_path: str | None = None
    # none | console | otlp | memory; None: the host's TracerProvider if it set one, else the OTEL_* environment
    otel_exporter: str | None = None
    otlp_endpoint: str | None = None  # None: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / _ENDPOINT (default localhost:4318)
    prometheus_port: int | None = None  # serve Prometheus metrics on this port (None: not served)
    prometheus_host: str = "127.0.0.1"  # the metrics listener's address (loopback unless configured)

    def __post_init__(self) -> None:
        check_port(self.prometheus_port, "tracing.prometheus_port")


def cpu_threads(configured: int | None) -> int:
    """Intra-op threads of a model stage on CPU: diffusion and decode run side by side (chunk n
    decodes while n + 1 diffuses), so each takes half the cores unless configured."""
    return configured or max(1, (os.cpu_count() or 2) // 2)
