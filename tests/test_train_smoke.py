import argparse
import json

import pytest
import torch
from safetensors import safe_open

from charstream.model.config import get_preset
from charstream.model.dit import DiT
from charstream.model.weights import build_model, load_audio_encoder, load_vae, merge
from charstream.pipeline.training import train
from charstream.pipeline.training.curves import LossLog

TINY_RUN = [
    "--device", "cpu", "--budget-s", "60", "--workers", "0", "--seed", "3",
    "--vae-steps", "2", "--vae-batch", "1", "--vae-clips", "1", "--vae-clip-frames", "8", "--vae-window-latents", "1",
    "--clips", "2", "--clip-frames", "24", "--dit-steps", "2", "--dit-batch", "1", "--dit-window", "2",
]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_cpu_smoke_run_writes_loadable_weights_and_curves(tmp_path):
    out = tmp_path / "run"
    assert train.main([*TINY_RUN, "--out", str(out)]) == 0
    for name in ("dit.safetensors", "vae_audio.safetensors", "loss_vae_recon.png", "loss_dit_loss.png"):
        assert (out / name).stat().st_size > 1000, name
    metrics = json.loads((out / "metrics.json").read_text())
    assert set(metrics["final"]) == {"vae_recon", "dit_loss"}
    assert all(0 < v < 100 for v in metrics["final"].values())  # finite, trained losses

    merged = merge([out / "dit.safetensors", out / "vae_audio.safetensors"], tmp_path / "tiny.safetensors")
    cfg = get_preset("tiny")
    dit = build_model(cfg, merged)  # the model helper's loader reads the DiT part, ignores the rest
    fresh = DiT(cfg).init_random_(3)
    assert not torch.equal(dit.blocks[0].w_in.weight, fresh.blocks[0].w_in.weight)  # the steps moved it
    vae, enc = load_vae(cfg, merged), load_audio_encoder(cfg, merged)
    with safe_open(str(merged), "pt") as f:
        assert torch.equal(vae.decoder.latent_std, f.get_tensor("vae.decoder.latent_std"))
    assert not torch.equal(vae.decoder.latent_std, torch.ones_like(vae.decoder.latent_std))  # stats were set
    assert enc.queries.shape[0] == cfg.n_audio_tokens


def test_vae_stage_is_reproducible_from_its_seed():
    cfg = get_preset("tiny")
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    args = parser.parse_args(TINY_RUN)
    states = []
    for _ in range(2):
        torch.manual_seed(args.seed)
        vae = train.VideoVAE(cfg)
        args.vae_steps = 1
        train.train_vae(vae, cfg, args, torch.device("cpu"), deadline=float("inf"), log=LossLog())
        states.append(vae.state_dict())
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
