"""Multi-rank diffusion on CPU (gloo, spawned processes): the TP group driven by rank 0 produces the
same frames as TP=1 -- the module body, and the fused FP8 step every GPU rank runs."""

from __future__ import annotations

import pytest
import torch

from charstream.model.config import TINY
from charstream.model.dit import DiT
from charstream.model.generator import Generator
from charstream.model.step import StepOptions
from charstream.model.vae import VideoVAE, to_uint8_frames
from charstream.model.weights import save_weights
from charstream.stages.diffusion.tp_group import TPGenerator

CFG = TINY.with_(n_blocks=2, height=64, width=64, window_frames=3, reset_every=2, rollback_frames=2)
STEPS = 5


def _frames(gen, vae: VideoVAE) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    gen.reset_session(torch.randn(CFG.latent_channels, CFG.latent_height, CFG.latent_width, generator=g))
    latents = [gen.step(torch.randn(CFG.n_audio_tokens, CFG.audio_dim, generator=g), seed=i) for i in range(STEPS)]
    gen.rollback(1)
    latents.append(gen.step(torch.randn(CFG.n_audio_tokens, CFG.audio_dim, generator=g), seed=99))
    with torch.inference_mode():
        video, _ = vae.decode(torch.stack(latents)[None])  # (1, 4 * frames, 3, H, W) in [-1, 1]
    return to_uint8_frames(video), torch.stack(latents)


@pytest.fixture(scope="module")
def single_rank(tmp_path_factory):
    path = tmp_path_factory.mktemp("w") / "tp.safetensors"
    save_weights(DiT(CFG).init_random_(seed=7), path)
    vae = VideoVAE(CFG).eval()
    one = {fused: _frames(Generator(CFG, weights=path, options=StepOptions(fused=fused)), vae) for fused in (False, True)}
    return path, vae, one


# (TP size, the fused FP8 step); the fused step's FP8 rows are quantized per rank, so it matches
# TP=1 within FP8 rounding (tests/test_model_tp.py).
@pytest.mark.parametrize("world,fused,tolerance", [(2, False, 1e-4), (4, False, 1e-4), (2, True, 1e-3)])
def test_tp_group_produces_the_frames_of_one_rank(single_rank, world, fused, tolerance):
    path, vae, one = single_rank
    frames, latents = one[fused]
    group = TPGenerator(CFG, world, weights=path, options=StepOptions(fused=fused))
    try:
        assert group.generator.diffusion.fused == fused
        tp_frames, tp_latents = _frames(group, vae)
    finally:
        group.close()
    rel = (tp_latents - latents).norm() / latents.norm()
    assert rel < tolerance, f"TP={world} latents differ from TP=1 by {rel:.2e}"
    assert tp_frames.shape == frames.shape
    assert (tp_frames.int() - frames.int()).abs().max() <= 1  # reduction order only
