"""``charstream train``: train the ``tiny`` character model (VAE, then audio encoder + DiT).

Stages, each time-boxed by the wall clock so a run always ends with saved weights:
1. **VAE** on rendered "babble" video (the character with a random speech-like mouth, no audio
   needed), L1 with the mouth box weighted up (lip sync lives there) + a small KL.
2. **Latents**: speech clips (espeak-ng, rendered on the training device) encoded once; per-channel
   latent statistics stored in the VAE so the DiT sees unit-scale latents.
3. **DiT + audio encoder**: flow matching at the sampler's fixed noise levels, teacher-forced
   over windows of latent frames with noise-augmented context (the model learns to work from
   its own imperfect past, so long autoregressive rollouts hold up).
Weights go to one safetensors file (``model/weights.py``); loss curves as PNG + JSON.

Speech synthesis runs in CPU worker processes while the VAE trains. Everything is seeded:
the same command, seed and device reproduce the run (up to GPU kernel nondeterminism).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import time
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from charstream.model.audio_encoder import AudioEncoder
from charstream.model.character import MOUTH_BOX, make_identity, reference_frame, render
from charstream.model.config import ModelConfig, get_preset
from charstream.model.dit import DiT
from charstream.model.sampler import noised
from charstream.model.teacher_forcing import teacher_forced_velocity
from charstream.model.vae import VideoVAE, to_video
from charstream.model.weights import save_parts
from charstream.pipeline.training.curves import LossLog
from charstream.pipeline.training.data import N_IDENTITIES, ClipScript, babble_motion, make_script

MOUTH_WEIGHT = 6.0  # the mouth box counts this much more in the VAE's reconstruction loss
LATENT_MOUTH_WEIGHT = 4.0  # and in the DiT's loss, on the latent cells under the mouth box
VAE_KL_WEIGHT = 1e-6
EMA_DECAY = 0.998


class Clock:
    """Wall-clock budget of the whole run; each stage gets a deadline."""

    def __init__(self, total_s: float) -> None:
        self.start = time.monotonic()
        self.total_s = total_s

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def at(self, fraction: float) -> float:
        """Monotonic time by which ``fraction`` of the budget is used."""
        return self.start + fraction * self.total_s


def mouth_weights(height: int, width: int, scale: int, weight: float, device: torch.device) -> torch.Tensor:
    """(1, 1, 1, height, width) loss weights, mean 1, ``weight`` x higher under the mouth box."""
    w = torch.ones(1, 1, 1, height, width, device=device)
    y0, y1, x0, x1 = MOUTH_BOX
    w[..., y0 // scale: -(-y1 // scale), x0 // scale: -(-x1 // scale)] = weight
    return w / w.mean()


def render_babble_pool(n_clips: int, n_frames: int, seed: int, device: torch.device) -> torch.Tensor:
    """uint8 (n_clips, n_frames, 3, H, W) of random identities with babbling mouths."""
    rng = np.random.default_rng([seed, 0xAE])
    pool = []
    for i in range(n_clips):
        ident = int(rng.integers(N_IDENTITIES))
        pool.append(render(make_identity(ident), babble_motion(n_frames, seed * 100_003 + i), device))
    return torch.stack(pool)


def _update(opt: torch.optim.Optimizer, params: Iterable[torch.Tensor], loss: torch.Tensor, lr: float) -> None:
    """One optimiser step on ``loss`` at learning rate ``lr``, the gradients of ``params`` clipped to norm 1."""
    for g in opt.param_groups:
        g["lr"] = lr
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()


def _logged(log: LossLog, bar: tqdm, name: str, step: int, value: float) -> int:
    """``value`` of the series ``name`` at ``step`` logged, and shown on ``bar`` every 50 steps; the next step."""
    log.add(name, step, value)
    bar.update(1)
    if (step + 1) % 50 == 0:
        bar.set_postfix({name: f"{value:.4f}"})
    return step + 1


def train_vae(vae: VideoVAE, cfg: ModelConfig, args: argparse.Namespace, device: torch.device,
              deadline: float, log: LossLog) -> None:
    pool = render_babble_pool(args.vae_clips, args.vae_clip_frames, args.seed, device)
    weights = mouth_weights(cfg.height, cfg.width, 1, MOUTH_WEIGHT, device)
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    opt = torch.optim.AdamW(vae.parameters(), lr=args.vae_lr, weight_decay=0.0)
    k = cfg.frames_per_chunk
    window = args.vae_window_latents * k
    vae.train()
    bar = tqdm(total=args.vae_steps, desc="vae", unit="step", mininterval=2.0)
    step = 0
    while step < args.vae_steps and (step == 0 or time.monotonic() < deadline):
        clip = torch.randint(0, pool.shape[0], (args.vae_batch,), generator=gen)
        start = torch.randint(0, (pool.shape[1] - window) // k + 1, (args.vae_batch,), generator=gen) * k
        idx = start[:, None] + torch.arange(window)[None]
        video = to_video(pool[clip[:, None].to(device), idx.to(device)])
        mean, logvar = vae.encoder(video)  # fp32 (TF32 matmuls): the VAE's causal convs are fp32-only
        z = mean + torch.randn_like(mean) * torch.exp(0.5 * logvar)
        recon, _ = vae.decoder(vae.normalize(z))
        rec = ((recon.float() - video).abs() * weights).mean()
        kl = 0.5 * (mean.float().square() + logvar.float().exp() - 1.0 - logvar.float()).mean()
        loss = rec + VAE_KL_WEIGHT * kl
        lr = args.vae_lr * 0.5 * (1 + np.cos(np.pi * min(1.0, step / args.vae_steps)))  # cosine decay over the steps
        _update(opt, vae.parameters(), loss, lr)
        step = _logged(log, bar, "vae_recon", step, rec.item())
    bar.close()
    # Latent statistics over the pool: the DiT works in per-channel unit scale.
    vae.eval()
    with torch.no_grad():
        sample = pool[: min(64, pool.shape[0]), : (pool.shape[1] // k) * k]
        raws = [vae.encoder(to_video(c[None]))[0] for c in sample]
        z = torch.cat(raws).movedim(2, 0).reshape(cfg.latent_channels, -1).float()  # (C, everything)
        vae.set_latent_stats(z.mean(dim=1), z.std(dim=1))
    print(f"vae: {step} steps, final recon {log.series['vae_recon'][-1][1]:.4f}", flush=True)


class Corpus:
    """Speech clips as the DiT trains on them: latents, log-mel features, identities, references."""

    def __init__(self, scripts: list[ClipScript], vae: VideoVAE, audio_encoder: AudioEncoder,
                 cfg: ModelConfig, device: torch.device) -> None:
        k = cfg.frames_per_chunk
        latents, feats = [], []
        with torch.no_grad():
            for script in tqdm(scripts, desc="encode", unit="clip", mininterval=2.0):
                frames = render(make_identity(script.identity), script.motion, device)
                n = (frames.shape[0] // k) * k
                latents.append(vae.encode(to_video(frames[None, :n]))[0].float())
                audio = torch.from_numpy(script.audio[: n * 2000].astype(np.float32) / 32768.0).to(device)
                feats.append(audio_encoder.clip_features(audio)[: n // k])
            refs = torch.stack([reference_frame(i, device) for i in range(N_IDENTITIES)])
            self.references = vae.encode_image(to_video(refs)).float()  # (identities, C, h, w)
        self.latents = torch.stack(latents)  # (clips, T, C, h, w)
        self.features = torch.stack(feats)  # (clips, T, mel frames, mels)
        self.identities = torch.tensor([s.identity for s in scripts], device=device)

    def batch(self, size: int, frames: int, gen: torch.Generator, from_start: float) -> tuple[torch.Tensor, ...]:
        """(x0 (B, F, C, h, w), features (B, F, ...), references (B, C, h, w)); a share ``from_start``
        of the windows begins at the clip's first chunk (a session's start)."""
        n_clips, n_t = self.latents.shape[:2]
        clip = torch.randint(0, n_clips, (size,), generator=gen)
        start = torch.randint(0, n_t - frames + 1, (size,), generator=gen)
        start[torch.rand(size, generator=gen) < from_start] = 0
        dev = self.latents.device
        idx = (start[:, None] + torch.arange(frames)[None]).to(dev)
        c = clip[:, None].to(dev)
        return self.latents[c, idx], self.features[c, idx], self.references[self.identities[clip.to(dev)]]


def dit_loss(dit: DiT, audio_encoder: AudioEncoder, corpus: Corpus, cfg: ModelConfig, args: argparse.Namespace,
             gen: torch.Generator, weights: torch.Tensor) -> torch.Tensor:
    """Teacher-forced flow-matching loss (model/teacher_forcing.py) with noise-augmented context.

    The ring holds each frame as its last sampler pass saw it: the model's own estimate, noised to
    the lowest level. Context frames here are the clean latent plus an error of random size
    (up to ``--context-noise``), then noised to that level, so the model learns to work from an
    imperfect past and long rollouts do not compound their errors.
    """
    device = weights.device
    b, f = args.dit_batch, args.dit_window
    x0, feats, refs = corpus.batch(b, f, gen, from_start=0.25)
    tokens = audio_encoder(feats.flatten(0, 1)).unflatten(0, (b, f))  # (B, F, A, dim)
    levels = torch.tensor(cfg.noise_levels, device=device)
    ctx_sigma = torch.full((b, f), cfg.noise_levels[-1], device=device)
    err = torch.rand(b, 1, 1, 1, 1, device=device) * args.context_noise
    context = noised(x0 + err * torch.randn_like(x0), torch.randn_like(x0), ctx_sigma)
    sigma = levels[torch.randint(0, len(levels), (b, f), device=device)]
    noise = torch.randn_like(x0)
    max_offset = max(0, cfg.window_frames + cfg.reset_every - f)
    t_offset = int(torch.randint(0, max_offset + 1, (1,), generator=gen))
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.autocast):
        v = teacher_forced_velocity(dit, refs, context, ctx_sigma, noised(x0, noise, sigma), sigma, tokens, t_offset)
    return ((v.float() - (noise - x0)) ** 2 * weights).mean()


def train_dit(dit: DiT, audio_encoder: AudioEncoder, corpus: Corpus, cfg: ModelConfig, args: argparse.Namespace,
              device: torch.device, deadline: float, log: LossLog) -> DiT:
    """Returns the EMA copy of the DiT (what ships); the audio encoder is trained jointly in place."""
    ema = DiT(cfg).to(device)
    ema.load_state_dict(dit.state_dict())
    ema.requires_grad_(False)
    params = list(dit.parameters()) + list(audio_encoder.parameters())
    opt = torch.optim.AdamW(params, lr=args.dit_lr, weight_decay=0.01, betas=(0.9, 0.98))
    gen = torch.Generator(device="cpu").manual_seed(args.seed + 1)
    weights = mouth_weights(cfg.latent_height, cfg.latent_width, cfg.vae_spatial, LATENT_MOUTH_WEIGHT, device)
    t0, stage_s = time.monotonic(), max(1.0, deadline - time.monotonic())
    dit.train()
    audio_encoder.train()
    bar = tqdm(total=args.dit_steps, desc="dit", unit="step", mininterval=2.0)
    step = 0
    while step < args.dit_steps and (step == 0 or time.monotonic() < deadline):
        progress = max(step / args.dit_steps, (time.monotonic() - t0) / stage_s)
        warm = min(1.0, (step + 1) / 200)
        # warm-up, then cosine decay over whichever ends first: steps or time
        lr = args.dit_lr * warm * (0.05 + 0.95 * 0.5 * (1 + np.cos(np.pi * min(1.0, progress))))
        loss = dit_loss(dit, audio_encoder, corpus, cfg, args, gen, weights)
        _update(opt, params, loss, lr)
        with torch.no_grad():
            decay = min(EMA_DECAY, (step + 1) / (step + 10))
            for e, p in zip(ema.parameters(), dit.parameters(), strict=True):
                e.lerp_(p, 1 - decay)
        step = _logged(log, bar, "dit_loss", step, loss.item())
    bar.close()
    print(f"dit: {step} steps in {time.monotonic() - t0:.0f} s, final loss {log.series['dit_loss'][-1][1]:.4f}",
          flush=True)
    return ema.eval()


def start_speech(args: argparse.Namespace) -> tuple[ProcessPoolExecutor | None, list]:
    """Speech clips synthesised by CPU workers while the VAE trains (spawned: no CUDA in children).

    With ``--workers 0`` they are made here, at once (the CPU smoke run).
    """
    seeds = [args.seed * 1_000_003 + i for i in range(args.clips)]
    if args.workers == 0:
        return None, [make_script(s, args.clip_frames, "train") for s in seeds]
    pool = ProcessPoolExecutor(max_workers=args.workers, mp_context=multiprocessing.get_context("spawn"))
    return pool, [pool.submit(make_script, s, args.clip_frames, "train") for s in seeds]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--out", type=Path, default=Path("runs/tiny"), help="checkpoints, curves, metrics")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--budget-s", type=float, default=480.0, help="wall-clock budget of the whole run")
    parser.add_argument("--vae-fraction", type=float, default=0.3, help="share of the budget for the VAE")
    parser.add_argument("--workers", type=int, default=max(1, (multiprocessing.cpu_count() or 2) - 2))
    # VAE
    parser.add_argument("--vae-steps", type=int, default=6000)
    parser.add_argument("--vae-batch", type=int, default=16)
    parser.add_argument("--vae-lr", type=float, default=1e-3)
    parser.add_argument("--vae-clips", type=int, default=256)
    parser.add_argument("--vae-clip-frames", type=int, default=64)
    parser.add_argument("--vae-window-latents", type=int, default=3)
    # speech clips for the DiT
    parser.add_argument("--clips", type=int, default=400)
    parser.add_argument("--clip-frames", type=int, default=192)
    # DiT
    parser.add_argument("--dit-steps", type=int, default=20000)
    parser.add_argument("--dit-batch", type=int, default=32)
    parser.add_argument("--dit-lr", type=float, default=5e-4)
    parser.add_argument("--dit-window", type=int, default=8, help="latent frames per training window")
    parser.add_argument("--context-noise", type=float, default=0.3,
                        help="largest error (std, in unit latent scale) added to context frames")
    parser.add_argument("--autocast", action=argparse.BooleanOptionalAction, default=torch.cuda.is_available(),
                        help="bf16 autocast for the DiT (default on with CUDA)")
    parser.add_argument("--weights", type=Path, default=None, help="output safetensors (default OUT/tiny.safetensors)")


def run(args: argparse.Namespace) -> int:
    cfg = get_preset(args.preset)
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    clock = Clock(args.budget_s)
    log = LossLog()
    speech_pool, pending = start_speech(args)
    vae = VideoVAE(cfg).to(device)
    train_vae(vae, cfg, args, device, clock.at(args.vae_fraction), log)
    scripts: list[ClipScript] = pending if speech_pool is None else [f.result() for f in pending]
    if speech_pool is not None:
        speech_pool.shutdown()
    print(f"speech: {len(scripts)} clips ready at {clock.elapsed():.0f} s", flush=True)
    audio_encoder = AudioEncoder(cfg).to(device)
    vae.requires_grad_(False)
    corpus = Corpus(scripts, vae, audio_encoder, cfg, device)
    print(f"corpus: {tuple(corpus.latents.shape)} latents at {clock.elapsed():.0f} s", flush=True)
    dit = DiT(cfg).to(device)
    dit.init_random_(args.seed)
    save_margin = 20.0  # seconds kept for saving weights and curves
    ema = train_dit(dit, audio_encoder, corpus, cfg, args, device, clock.at(1.0) - save_margin, log)
    parts = save_parts(args.out, ema.cpu(), vae.cpu(), audio_encoder.cpu())
    print(f"weights: {', '.join(str(p) for p in parts)} at {clock.elapsed():.0f} s", flush=True)
    log.save(args.out)
    metrics = {"preset": cfg.name, "seed": args.seed, "elapsed_s": clock.elapsed(),
               "final": {k: v[-1][1] for k, v in log.series.items() if v}}
    (args.out / "metrics.json").write_text(json.dumps(metrics, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m charstream.pipeline.training.train`` (the GPU machine runs it so, without the CLI's imports)."""
    parser = argparse.ArgumentParser(description="train the tiny character model")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
