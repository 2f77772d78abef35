"""FlashHead's chunk sampler: 4 flow-matching passes with stochastic re-noising, motion latents pinned.

Each pass predicts the velocity v at sigma, takes x0 = x - sigma v and re-noises it to the next level:
x = (1 - sigma') x0 + sigma' eps (sigma' = 0 after the last pass). Before every pass (and after the
last) the chunk's leading latents are overwritten with the motion latents -- the previous chunk's last
frames re-encoded (or, for the first chunk, the reference image's latent) -- so the chunk continues them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from charstream.model.families.flashhead.config import FlashHeadConfig
from charstream.model.families.flashhead.dit import FlashHeadDiT
from charstream.model.families.flashhead.noise import randn_rows


def chunk_timesteps(cfg: FlashHeadConfig) -> Tensor:
    """The passes' timesteps (sigma x 1000) and a final 0, in fp32: 1000, 937.5, 833.3, 625, 0."""
    return torch.tensor([s * cfg.num_timesteps for s in cfg.sigmas] + [0.0], dtype=torch.float32)


def chunk_noise(cfg: FlashHeadConfig, shape: Sequence[int], generator: torch.Generator | Sequence[torch.Generator],
                dtype: torch.dtype, device: torch.device | str) -> Tensor:
    """A chunk's noise, (passes + 1, *shape): its start, then one draw per pass (the last one too, scaled by 0),
    drawn from ``generator`` (or one per batch row) in that order, so a seed's stream matches the released
    sampler's chunk after chunk."""
    return torch.stack([randn_rows(shape, generator, dtype, device) for _ in range(len(cfg.sigmas) + 1)])


@torch.no_grad()
def denoise_chunk(
    dit: FlashHeadDiT,
    reference: Tensor,
    audio: Tensor,
    motion: Tensor,
    noise: Tensor,
    timesteps: Tensor,
    on_pass: Callable[[int, Tensor], None] | None = None,
) -> Tensor:
    """Denoise one chunk from its drawn ``noise`` (``chunk_noise``) at ``timesteps`` (``chunk_timesteps`` on the
    latents' device): no host work, so a CUDA graph can hold it. Arguments and result as ``sample_chunk``'s."""
    cfg = dit.cfg
    batch = reference.shape[0]
    x = noise[0].clone()
    m = motion.shape[2]
    for i in range(len(cfg.sigmas)):
        x[:, :, :m] = motion
        velocity = dit(x, reference, timesteps[i].expand(batch), audio)
        # the update runs in the latents' dtype, as the released sampler's (sigma 0.8333 is 0.832 in bf16)
        sigma = (timesteps[i] / cfg.num_timesteps).to(x.dtype)
        sigma_next = (timesteps[i + 1] / cfg.num_timesteps).to(x.dtype)
        clean = x - velocity * sigma
        x = (1 - sigma_next) * clean + sigma_next * noise[i + 1]
        if on_pass is not None:
            on_pass(i, x)
    x[:, :, :m] = motion
    return x


def sample_chunk(
    dit: FlashHeadDiT,
    reference: Tensor,
    audio: Tensor,
    motion: Tensor,
    generator: torch.Generator | Sequence[torch.Generator],
    on_pass: Callable[[int, Tensor], None] | None = None,
) -> Tensor:
    """Denoise one chunk.

    reference: (batch, C, latents, h, w) reference-image latents; audio: (batch, latents, tokens, d);
    motion: (batch, C, m, h, w), m <= latents. Noise is drawn from ``generator`` (or one per batch row) on the
    latents' device in their dtype (``chunk_noise``). ``on_pass(i, x)``, if given, sees the latents after each
    pass. Returns the denoised latents, motion latents in place.
    """
    cfg = dit.cfg
    noise = chunk_noise(cfg, reference.shape, generator, reference.dtype, reference.device)
    return denoise_chunk(dit, reference, audio, motion, noise, chunk_timesteps(cfg).to(reference.device), on_pass)
