"""Model presets, in one place. Presets are data: every size-dependent choice reads these fields."""

from __future__ import annotations

from dataclasses import dataclass, replace


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

    def with_(self, **changes) -> ModelConfig:
        return replace(self, **changes)


TINY = ModelConfig(
    name="tiny",
    dim=192,
    n_heads=12,  # divisible by 2, 3 and 4: every TP layout is testable on CPU
    head_dim=16,
    n_blocks=6,
    ffn_dim=768,
    height=128,
    width=128,
    frames_per_chunk=4,
    vae_spatial=8,
    latent_channels=8,
    patch=2,
    vae_channels=(128, 64, 32),
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
)

PRESETS: dict[str, ModelConfig] = {c.name: c for c in (TINY, CHARACTERS_57B)}


def get_preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(sorted(PRESETS))}") from None
