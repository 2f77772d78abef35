"""Each stage's typed config section; ``charstream.pipeline.config.PipelineConfig`` composes them.

Every field has the one default that runs the embedded CPU demo: a stage is built from its section
and reads no other default.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from charstream.config_checks import PORT, CheckedSection, check_number, within
from charstream.model.step.options import StepOptions

AGENT_PACES = ("realtime", "synthesized")  # IngestConfig.agent_pace
RECOGNIZERS = ("moonshine", "whisper", "pocketsphinx-domain", "pocketsphinx-general")  # IngestConfig.recognizer


@dataclass
class IngestConfig(CheckedSection):
    SECTION = "ingest"

    adapter: str = "listening"  # listening (the built-in agent: hears the mic) | scripted | zmq | pipecat | livekit
    # built-in agent's speech recogniser, all offline: moonshine (base) | whisper (tiny.en) | pocketsphinx-domain
    # (the conversation's trigram) | pocketsphinx-general (stages/agents/asr.py; pipeline/bench/asr.py measures them)
    recognizer: str = "moonshine"
    think_delay_s: float = field(default=0.4, metadata=within(0, 60))  # stands for STT + LLM in the scripted agent
    user_voice: str = "en-us"
    agent_voice: str = "en+f3"
    # a threshold silero's probability never passes makes the character deaf, without an error
    vad_threshold: float = field(default=0.5, metadata=within(0, 1, low_open=True, high_open=True,
                                                                what="a speech probability in (0, 1)"))
    vad_silence_ms: int = field(default=300, metadata=within(1, 10_000))  # end of speech is back-dated by this window
    vad_start_ms: int = field(default=64, metadata=within(1, 10_000))  # speech this long (consecutive 32 ms windows) starts a user turn / barge-in
    max_ahead_s: float = field(default=0.25, metadata=within(0.02, 60))  # agent audio is emitted at most this far ahead of the media clock (or one chunk, if longer)
    playout_tail_s: float = field(default=1.0, metadata=within(0, 10))  # user speech this long after the agent's audio ended still barges in (pipeline latency)
    zmq_endpoint: str = "tcp://127.0.0.1:5790"
    zmq_dead_after_s: float = field(default=1.5, metadata=within(0.1, 86_400))  # an external agent silent this long (no audio, no ping) is gone
    zmq_curve_secret_key: str | None = None  # Z85 CURVE secret of the agent socket; required off loopback
    zmq_curve_agents: list[str] = field(default_factory=list)  # Z85 public keys of the agents let in (with CURVE)
    script: list[dict] | None = None  # scripted agent: [{"user", "agent", "barge_in_after_s"?}]; None = built-in
    lead_in_s: float = field(default=0.5, metadata=within(0, 60))  # scripted agent: silence before the user's first line
    turn_gap_s: float = field(default=1.5, metadata=within(0, 60))  # scripted agent: silence after a reply before the next line (> playout_tail_s)
    # scripted agent's reply: "realtime" (one 20 ms frame per 20 ms) | "synthesized" (as a TTS service
    # pushes it: what is synthesised -- espeak makes the whole line at once -- up to max_ahead_s ahead)
    agent_pace: str = "realtime"
    # scripted agent: its user's speech also goes through the built-in recogniser (``recognizer``), so each
    # turn says what was heard; off, turns carry no "heard" (a capacity run: a real agent's STT runs elsewhere)
    scripted_recognizer: bool = True

    def check_together(self) -> None:
        if self.recognizer not in RECOGNIZERS:
            self.refuse("recognizer", f"one of {', '.join(RECOGNIZERS)}, got {self.recognizer!r}")


@dataclass
class ConditioningConfig(CheckedSection):
    SECTION = "conditioning"

    device: str = "cpu"  # the audio encoder's (pipeline/runtime/layouts.py: the decoder's GPU, beside the edge's CPU work)
    graphed: bool = True  # on CUDA: a chunk's encode as one CUDA graph replay (model/graphed_audio_encoder.py)
    idle_lead_chunks: int | None = field(default=4, metadata=within(1, 1000))  # listening chunks are emitted at most this far ahead of real time
    rollback_wait_s: float = field(default=0.5, metadata=within(0.01, 60))  # no ROLLBACK answer to a TURN_START this long: place the speech anyway
    stall_s: float = field(default=1.0, metadata=within(0.1, 600))  # a speaking turn whose agent sends nothing this long is ended
    # > 1: the sessions of one serving process encode their due windows in one batch of up to this many
    # (stages/conditioning/batcher.py; families whose conditioner has ``encode_batch``: FlashHead)
    batch_sessions: int = field(default=1, metadata=within(1, 256))
    batch_window_s: float = field(default=0.005, metadata=within(0, 1))  # a batch waits at most this long after its first window


@dataclass
class DiffusionConfig(CheckedSection):
    SECTION = "diffusion"

    tp: int = field(default=1, metadata=within(1, 64))
    device: str = "cpu"  # rank 0's device; ranks 1.. use ``devices`` (pipeline/runtime/layouts.py fills both)
    devices: list[str] = field(default_factory=list)  # one per TP rank; empty = ``device`` for every rank
    seed: int = field(default=0, metadata=within(0, 2**63 - 1))
    fp8_cache: bool | None = None  # FP8 e4m3 ring; None: on CUDA devices (the CPU keeps the model's dtype)
    threads: int | None = field(default=None, metadata=within(1, 1024))  # CPU intra-op threads; None: half the cores (decode runs beside it)
    # every rank's step: fused body, CUDA graphs, the full window's attention (model/step/options.py)
    step: StepOptions = field(default_factory=StepOptions)
    # > 1: the sessions of one serving process share one model and batch their due steps into one
    # forward of up to this many (stages/diffusion/batcher.py; the module body, CUDA-graphed per batch size)
    batch_sessions: int = field(default=1, metadata=within(1, 256))
    batch_window_s: float = field(default=0.01, metadata=within(0, 1))  # a forward waits at most this long after its first step for the others

    def fp8_ring(self) -> bool:
        """Whether the KV ring holds FP8: ``fp8_cache``, or when None, on a CUDA device."""
        return self.device.startswith("cuda") if self.fp8_cache is None else self.fp8_cache


@dataclass
class DecodeConfig(CheckedSection):
    SECTION = "decode"

    device: str = "cpu"
    # on CUDA: the decoder as one CUDA graph per chunk (model/graphed_decoder.py); FlashHead's batched decode, one per batch size
    graphed: bool = True
    threads: int | None = field(default=None, metadata=within(1, 1024))  # CPU intra-op threads; None: half the cores (diffusion runs beside it)
    # > 1: the sessions of one serving process share one decoder and decode their due chunks in one
    # forward of up to this many (stages/decode/batcher.py; CUDA-graphed per batch size); decode then
    # runs in the serving process
    batch_sessions: int = field(default=1, metadata=within(1, 256))
    batch_window_s: float = field(default=0.01, metadata=within(0, 1))  # a forward waits at most this long after its first chunk for the others


@dataclass
class PlayoutConfig(CheckedSection):
    SECTION = "playout"

    target_depth_chunks: int = field(default=2, metadata=within(0, 64))  # chunks queued behind the playing one: absorbs a stall of this many chunks
    max_depth_chunks: int = field(default=8, metadata=within(1, 256))  # a full buffer withholds credit from decode (backpressure)
    history_frames: int = field(default=48, metadata=within(1, 900))  # released frames (pixels + audio) kept for egress readers that start late (30 s at 30 fps at most)
    # What the speech placement allows beyond its estimate until a turn has been measured, then halved with
    # each measured turn while the allowance learned from the turns' errors takes over (stages/playout/speech_estimate.py):
    # one chunk -- a session's first turn ran a chunk 58-155 ms behind its schedule (docs/PERF.md);
    # None: one chunk of the session's timeline
    initial_allowance_s: float | None = field(default=None, metadata=within(0, 10))

    def check_together(self) -> None:
        if self.max_depth_chunks <= self.target_depth_chunks:  # the clock would wait for a depth never reached
            self.refuse("max_depth_chunks", f"{self.max_depth_chunks} must exceed {self.key('target_depth_chunks')} "
                                            f"({self.target_depth_chunks})")


def check_port(port: int | None, name: str = "") -> None:
    """A TCP port a listener binds (None: none): 0-65535, 0 picking a free one."""
    if port is not None:
        try:
            check_number(name, port, int, PORT["bounds"])
        except ValueError as e:
            raise ValueError(str(e).removeprefix(": ")) from None


@dataclass
class EgressConfig(CheckedSection):
    SECTION = "egress"

    host: str = "127.0.0.1"
    port: int = field(default=8080, metadata=PORT)
    codec: str = "VP8"  # VP8 | H264
    max_sessions: int = field(default=16, metadata=within(1, 10_000))
    offer_timeout_s: float = field(default=30.0, metadata=within(0.1, 3600))  # a reserved session with no offer by then is released
    ice_servers: list[str] = field(default_factory=list)  # STUN/TURN URLs; none on loopback/LAN (never a public default)
    ping_interval_s: float = field(default=1.0, metadata=within(0.05, 60))  # data-channel ping: clock offset estimate + liveness
    client_timeout_s: float = field(default=10.0, metadata=within(0.5, 3600))  # no pong this long: the client vanished, its session is closed
    # 20 ms mic frames held for ingest before the oldest is dropped: 10 s, so the user's first words,
    # spoken while the session's stages still load (seconds on a CPU), wait instead of being lost
    user_audio_queue_frames: int = field(default=500, metadata=within(1, 50_000))
    # Host header names served besides IP literals, "localhost" and `host` (a DNS-rebinding page
    # sends its own name): add the names a LAN or proxy setup reaches this server by.
    allowed_hosts: list[str] = field(default_factory=list)
    idle_timeout_s: float = field(default=10.0, metadata=within(0.05, 3600))  # a connection without a complete request for this long is closed
    body_timeout_s: float = field(default=10.0, metadata=within(0.05, 3600))  # a request body must arrive within this
    # Live sessions (reserved or connected) per client address: one address opening page after page
    # must leave the other slots to other clients. Capped at max_sessions.
    sessions_per_client: int = field(default=4, metadata=within(1, 10_000))
    reservations_per_client: int = field(default=2, metadata=within(1, 10_000))  # reserved sessions still waiting for their offer, per client address
    reservations_per_minute: int = field(default=12, metadata=within(1, 1_000_000))  # new reservations per client address and minute (renewals count)
    memory_trim_s: float = field(default=30.0, metadata=within(1, 86_400, off=0))  # the serving process returns glibc's free memory to the OS this often (0: never)
    # A response the client does not read (its socket's buffer full) for this long: the connection is dropped
    write_timeout_s: float = field(default=10.0, metadata=within(0.05, 3600))
    # ICE candidates an offer may list (distinct ones; a browser on a host with several interfaces lists
    # a dozen or more: fewer would refuse it)
    max_offer_candidates: int = field(default=32, metadata=within(16, 256))

    def check_together(self) -> None:
        # no pong within one ping interval would end every session at its first ping
        if self.client_timeout_s <= self.ping_interval_s:
            self.refuse("client_timeout_s", f"{self.client_timeout_s:g} must exceed {self.key('ping_interval_s')} "
                                            f"({self.ping_interval_s:g})")


@dataclass
class TracingConfig(CheckedSection):
    SECTION = "tracing"

    jsonl_path: str | None = None
    # none | console | otlp | memory; None: the host's TracerProvider if it set one, else the OTEL_* environment
    otel_exporter: str | None = None
    otlp_endpoint: str | None = None  # None: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / _ENDPOINT (default localhost:4318)
    prometheus_port: int | None = field(default=None, metadata=PORT)  # serve Prometheus metrics on this port (None: not served)
    prometheus_host: str = "127.0.0.1"  # the metrics listener's address (loopback unless configured)



def cpu_threads(configured: int | None) -> int:
    """Intra-op threads of a model stage on CPU: diffusion and decode run side by side (chunk n
    decodes while n + 1 diffuses), so each takes half the cores unless configured."""
    return configured or max(1, (os.cpu_count() or 2) // 2)
