"""SoulX-FlashHead's sizes, in one place: a Wan2.1-T2V-1.3B DiT with a wav2vec2 audio adapter.

Pro and Lite share the transformer (d 1536, 12 heads x 128, 30 blocks, FFN 8,960) and the audio side;
they differ in their VAE (Wan2.1: 16 channels, 4x8x8; LTX-Video: 128 channels, 8x32x32) and so in the
DiT's patch, input/output channels and the audio adapter's window per latent frame.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


def shift_sigma(sigma: float, shift: float) -> float:
    """The sampler's timestep shift: sigma' = shift * sigma / (1 + (shift - 1) * sigma)."""
    return shift * sigma / (1 + (shift - 1) * sigma)


@dataclass(frozen=True)
class FlashHeadConfig:
    name: str
    variant: str  # "pro" or "lite": which VAE the latents belong to
    # transformer
    dim: int = 1536
    n_heads: int = 12
    n_blocks: int = 30
    ffn_dim: int = 8960
    freq_dim: int = 256  # sinusoidal timestep embedding width
    text_dim: int = 4096  # the unused text embedding's input width (its tensors are in the checkpoint)
    eps: float = 1e-6
    latent_channels: int = 16  # the VAE's; the DiT reads noise and reference latents stacked (2x)
    patch: tuple[int, int, int] = (1, 2, 2)  # (t, h, w) on the latent grid
    vae_stride: tuple[int, int, int] = (4, 8, 8)  # (t, h, w) of the VAE
    # the VAE's channels as a fraction of the released one's: below 1 only with random weights (a CPU check)
    vae_width: float = 1.0
    # video timeline
    height: int = 512
    width: int = 512
    fps: int = 25
    frames_per_chunk: int = 33  # decoded frames the DiT generates at once
    motion_latents: int = 2  # leading latents re-encoded from the previous chunk's last frames
    # latents decoded first, their new frames sent ahead of the rest (0: the chunk decoded at once); Pro's
    # 4 give 8 frames (320 ms) to show while its other 5 latents decode
    lead_latents: int = 0
    # audio
    sample_rate: int = 16000
    audio_context_s: int = 8  # rolling speech context re-encoded every chunk
    audio_layers: int = 12  # wav2vec2-base hidden layers, all of them stacked
    audio_dim: int = 768
    audio_window: int = 5  # video frames of audio features around each frame
    adapter_dim: int = 512
    audio_tokens: int = 32  # context tokens per latent frame
    # sampler: 4 passes, the base levels shifted (1, 0.75, 0.5, 0.25 -> 1, 0.9375, 0.8333, 0.625)
    base_sigmas: tuple[float, ...] = (1.0, 0.75, 0.5, 0.25)
    sigma_shift: float = 5.0
    num_timesteps: int = 1000  # the DiT's timestep is sigma x this

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def in_channels(self) -> int:
        return 2 * self.latent_channels  # noise + reference-image latent

    @property
    def rope_split(self) -> tuple[int, int, int]:
        """Channels per head rotated by (frame, row, column): 44/42/42 at head_dim 128."""
        hw = 2 * (self.head_dim // 6)
        return self.head_dim - 2 * hw, hw, hw

    @property
    def latents_per_chunk(self) -> int:
        return (self.frames_per_chunk - 1) // self.vae_stride[0] + 1  # causal VAE: 1 + 4 (or 8) per latent

    @property
    def motion_frames(self) -> int:
        """Decoded frames re-encoded into the motion latents: 5 (Pro), 9 (Lite)."""
        return (self.motion_latents - 1) * self.vae_stride[0] + 1

    @property
    def new_frames_per_chunk(self) -> int:
        return self.frames_per_chunk - self.motion_frames

    @property
    def lead_frames(self) -> int:
        """New frames of the ``lead_latents`` part (0 without one)."""
        if not self.lead_latents:
            return 0
        return (self.lead_latents - 1) * self.vae_stride[0] + 1 - self.motion_frames

    @property
    def latent_grid(self) -> tuple[int, int]:
        return self.height // self.vae_stride[1], self.width // self.vae_stride[2]

    @property
    def tokens_per_latent(self) -> int:
        h, w = self.latent_grid
        return (h // self.patch[1]) * (w // self.patch[2])

    @property
    def grouped_window(self) -> int:
        """Audio frames the adapter reads per later latent: the group's edge frames keep 3 of their 5-frame
        window (no past / no future inside the group), the middle ones only their centre frame."""
        return self.audio_window + self.vae_stride[0] - 1

    @property
    def sigmas(self) -> tuple[float, ...]:
        return tuple(shift_sigma(s, self.sigma_shift) for s in self.base_sigmas)

    def __post_init__(self) -> None:
        if self.lead_latents and not self.motion_latents < self.lead_latents < self.latents_per_chunk:
            raise ValueError(f"lead_latents must be 0 or between motion_latents ({self.motion_latents}) and the "
                             f"chunk's {self.latents_per_chunk} latents, got {self.lead_latents}")

    def with_(self, **changes) -> FlashHeadConfig:
        return replace(self, **changes)


PRO = FlashHeadConfig(name="flashhead-pro", variant="pro", lead_latents=4)
LITE = FlashHeadConfig(
    name="flashhead-lite", variant="lite", latent_channels=128, patch=(1, 1, 1), vae_stride=(8, 32, 32)
)
# The tests' size: the real width and audio side, 2 blocks (what parity needs: a block after a block).
TEST = PRO.with_(name="flashhead-test", n_blocks=2)
VARIANTS = {"pro": PRO, "lite": LITE}
