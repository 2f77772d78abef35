"""Model presets, in one place. Presets are data: every size-dependent choice reads these fields."""

from __future__ import annotations

from dataclasses import dataclass, replace

from charstream.timeline import TIMELINE_RATE


@dataclass(frozen=True)
class ModelConfig:
    name: str
    # transformer
    dim: int
    n_heads: int
    head_dim: int
    n_blocks: int
    ffn_dim: int
    # video and VAE
    height: int
    width: int
    frames_per_chunk: int  # video frames per latent frame (= VAE temporal factor)
    vae_spatial: int  # VAE spatial downsampling factor
    latent_channels: int
    patch: int  # DiT patch size on the latent grid
    vae_channels: tuple[int, ...]  # VAE decoder widths, coarse to fine
    # audio
    audio_rate: int  # the encoder's internal rate (the timeline is 48 kHz)
    n_audio_tokens: int  # audio tokens per step (per chunk)
    audio_dim: int  # width of one audio token
    audio_lookahead_ms: float
    # KV ring cache and sampler
    sink_frames: int  # reference/identity frames, written once per session
    window_frames: int  # ring of W latent frames
    reset_every: int  # position reset (delta rotation) every R steps
    noise_levels: tuple[float, ...]  # the 4 fixed flow-matching levels, high to low
    rollback_frames: int = 4  # ring storage beyond the window, so a turn-start rollback of this many is exact
    kv_headroom: float = 2.0  # FP8 per-head scale = headroom x the sink frame's amax / 448 (docs/MODEL.md)
    audio_context_ms: float = 80.0  # left context of a chunk's audio window (model/audio_encoder.py)
    audio_layers: int = 2  # transformer layers of the audio encoder

    @property
    def latent_height(self) -> int:
        return self.height // self.vae_spatial

    @property
    def latent_width(self) -> int:
        return self.width // self.vae_spatial

    @property
    def grid(self) -> tuple[int, int]:
        """Token grid (h, w) of one latent frame after patching."""
        return self.latent_height // self.patch, self.latent_width // self.patch

    @property
    def video_tokens(self) -> int:
        h, w = self.grid
        return h * w

    @property
    def tokens_per_step(self) -> int:
        """New tokens per step: one latent frame's video tokens plus the chunk's audio tokens."""
        return self.video_tokens + self.n_audio_tokens

    @property
    def cache_slots(self) -> int:
        """Cached key/value slots per layer (sink + ring), in tokens."""
        return (self.sink_frames + self.window_frames) * self.tokens_per_step

    @property
    def ring_frames(self) -> int:
        """Ring storage in frames: the attention window plus the rollback margin."""
        return self.window_frames + self.rollback_frames

    @property
    def storage_slots(self) -> int:
        """Slots allocated per layer: sink + ring storage (window + rollback margin)."""
        return (self.sink_frames + self.ring_frames) * self.tokens_per_step

    def with_(self, **changes) -> ModelConfig:
        return replace(self, **changes)

    def validate(self, tp: int = 1) -> ModelConfig:
        """Raise ValueError naming the first inconsistent field; returns self so calls chain."""
        problems = []
        if self.n_heads * self.head_dim != self.dim:
            problems.append(f"n_heads x head_dim = {self.n_heads} x {self.head_dim} != dim {self.dim}")
        if tp < 1 or self.n_heads % tp:
            problems.append(f"n_heads {self.n_heads} is not divisible by the tensor-parallel size {tp}")
        if tp >= 1 and self.ffn_dim % tp:
            problems.append(f"ffn_dim {self.ffn_dim} is not divisible by the tensor-parallel size {tp}")
        cell = self.vae_spatial * self.patch
        if self.height % cell or self.width % cell:
            problems.append(f"{self.height}x{self.width} video is not a multiple of VAE x patch = {cell}")
        if self.head_dim % 2 or self.head_dim < 6:
            problems.append(f"head_dim {self.head_dim} cannot hold 3-D RoPE (even, >= 6)")
        if TIMELINE_RATE % self.audio_rate or self.audio_rate < 8_000:
            problems.append(
                f"audio_rate {self.audio_rate} Hz must divide the {TIMELINE_RATE} Hz timeline and be >= 8 kHz"
            )
        if self.n_audio_tokens < 1:
            problems.append("n_audio_tokens must be >= 1")
        if self.sink_frames < 1 or self.window_frames < 1 or self.rollback_frames < 0:
            problems.append("sink_frames and window_frames must be >= 1, rollback_frames >= 0")
        if self.reset_every < 1:
            problems.append(f"reset_every {self.reset_every} must be >= 1")
        levels = self.noise_levels
        decreasing = all(0 < b < a for a, b in zip(levels, levels[1:], strict=False))
        if len(levels) != 4 or levels[0] != 1.0 or not decreasing:
            problems.append(f"noise_levels {levels} must be 4 strictly decreasing levels from 1.0 (pure noise)")
        if self.kv_headroom < 1:
            problems.append(f"kv_headroom {self.kv_headroom} must be >= 1")
        if problems:
            raise ValueError(f"model config {self.name!r}: " + "; ".join(problems))
        return self


TINY = ModelConfig(
    name="tiny",
    dim=192,
    n_heads=12,  # divisible by 2, 3 and 4: every TP layout is testable on CPU
    head_dim=16,
    n_blocks=3,
    ffn_dim=768,
    height=128,
    width=128,
    frames_per_chunk=4,
    vae_spatial=8,
    latent_channels=8,
    patch=4,  # 4 x 4 video tokens + 4 audio: few tokens keep a CPU step inside the budget
    vae_channels=(80, 40, 20),
    audio_rate=16_000,
    n_audio_tokens=4,
    audio_dim=192,
    audio_lookahead_ms=40.0,
    sink_frames=1,
    window_frames=8,
    reset_every=42,
    noise_levels=(1.0, 0.75, 0.5, 0.25),
)

CHARACTERS_57B = ModelConfig(
    name="characters-57b",
    dim=7680,
    n_heads=60,
    head_dim=128,
    n_blocks=60,
    ffn_dim=30720,
    height=704,
    width=1088,
    frames_per_chunk=4,
    vae_spatial=16,
    latent_channels=48,
    patch=2,
    vae_channels=(512, 256, 128, 64),
    audio_rate=16_000,
    n_audio_tokens=9,  # 748 video + 9 audio = 757 new tokens per step
    audio_dim=1024,
    audio_lookahead_ms=40.0,
    sink_frames=1,
    window_frames=7,  # (1 + 7) x 757 = 6,056 slots; the reference quotes 5,788 (see docs)
    reset_every=42,
    noise_levels=(1.0, 0.75, 0.5, 0.25),
    rollback_frames=3,
)

# The size class of the public real-time avatar models, on the same 704x1088 / 24 fps timeline: one
# H200 holds it whole (TP = 1, ~28 GB of bf16 weights + their FP8 copies) with its decoder.
CHARACTERS_14B = CHARACTERS_57B.with_(name="characters-14b", dim=5120, n_heads=40, head_dim=128, n_blocks=40,
                                      ffn_dim=13_824)

PRESETS: dict[str, ModelConfig] = {c.name: c for c in (TINY, CHARACTERS_57B, CHARACTERS_14B)}


def get_preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(sorted(PRESETS))}") from None
