"""The teacher-forced training forward computes what inference computes, and trains."""

from __future__ import annotations

import torch

from charstream.model.config import TINY
from charstream.model.generator import Generator
from charstream.model.teacher_forcing import teacher_forced_velocity

CFG = TINY.with_(n_blocks=2, height=64, width=64, window_frames=2, reset_every=42)
FRAMES = 4  # more than the window: the sliding block-causal mask is exercised


def test_teacher_forced_forward_equals_inference_passes():
    gen = Generator(CFG, fp8_cache=False, seed=4)
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(CFG.latent_channels, CFG.latent_height, CFG.latent_width, generator=g)
    audio = torch.randn(FRAMES, CFG.n_audio_tokens, CFG.audio_dim, generator=g)
    passes: list[tuple[torch.Tensor, float, torch.Tensor]] = []
    forward = gen.model.forward

    def recording(latents, sigma, *args, **kwargs):
        v = forward(latents, sigma, *args, **kwargs)
        passes.append((latents.clone(), float(sigma.flatten()[0]), v.clone()))
        return v

    gen.model.forward = recording
    gen.reset_session(ref)
    passes.clear()
    for i in range(FRAMES):
        gen.step(audio[i], seed=i)
    levels = len(CFG.noise_levels)
    # context = each frame's last-pass input; targets = each frame's inputs at every level
    context = torch.cat([passes[i * levels + levels - 1][0] for i in range(FRAMES)], dim=1)
    for level in range(levels):
        target = torch.cat([passes[i * levels + level][0] for i in range(FRAMES)], dim=1)
        want = torch.cat([passes[i * levels + level][2] for i in range(FRAMES)], dim=1)
        with torch.no_grad():
            got = teacher_forced_velocity(
                gen.model, ref[None], context, torch.full((1, FRAMES), CFG.noise_levels[-1]),
                target, torch.full((1, FRAMES), CFG.noise_levels[level]), audio[None],
            )
        assert ((got - want).norm() / want.norm()).item() < 1e-4
