"""Lab script (not shipped): FlashHead Pro on one GPU, our modules against the released inference code.

Both get the same seeded random weights of the real Pro config (843 tensors in the checkpoint's names),
bf16, 512x512 (9 latents of 64x64, 9,216 tokens), the same reference latent, audio features and noise
stream. Per pass: the relative difference of the velocities on the same input (each pass fed the
released model's latents), and of the latents when each side follows its own trajectory, over 3 chunks
(the next chunk's 2 motion latents are the previous chunk's last 2 latents: no VAE here, so the
decode -> colour match -> encode round trip is left out). Then one DiT pass's time, eager and compiled.

    python scripts/flashhead_gpu.py --theirs DIR --out DIR

DIR for --theirs holds the released ``flash_head_model.py`` (and stand-ins for the modules it imports
only for multi-GPU runs).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from charstream.model.families.flashhead.config import PRO
from charstream.model.families.flashhead.loader import build, random_checkpoint
from charstream.model.families.flashhead.sampler import chunk_timesteps, sample_chunk
from charstream.pipeline.bench.output import cuda_median_ms

BF16 = torch.bfloat16


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def released_model(folder: str, state: dict, device: str):
    sys.path.insert(0, folder)
    from flash_head_model import WanModelAudioProject

    with torch.device(device):
        model = WanModelAudioProject(
            dim=1536, in_dim=32, ffn_dim=8960, out_dim=16, text_dim=4096, freq_dim=256, eps=1e-6,
            vae_stride=(4, 8, 8), patch_size=(1, 2, 2), num_heads=12, num_layers=30, has_image_input=False,
        )  # fmt: skip
    model.load_state_dict(state, strict=True)
    return model.to(BF16).eval().requires_grad_(False)


def released_timesteps(device: str) -> list[torch.Tensor]:
    """The released pipeline's 4-step schedule: 1000, 750, 500, 250, 0, shifted by 5, fp32."""
    out = []
    for t in (1000.0, 750.0, 500.0, 250.0, 0.0):
        s = torch.tensor([t], device=device) / 1000
        out.append(5.0 * s / (1 + 4.0 * s) * 1000)
    return out


@torch.no_grad()
def released_chunk(model, reference, audio, motion, generator, timesteps, record):
    """The released pipeline's chunk loop (FlashHeadPipeline.generate, its DiT part)."""
    noise = torch.randn(16, 9, 64, 64, dtype=BF16, device=reference.device, generator=generator)
    for i in range(4):
        noise[:, : motion.shape[1]] = motion
        x_in = noise.clone()
        flow = model(x=noise.unsqueeze(0), timestep=timesteps[i], context=audio, y=reference.unsqueeze(0))[0]
        t_i = (timesteps[i][:, None, None, None] / 1000).to(BF16)
        t_next = (timesteps[i + 1][:, None, None, None] / 1000).to(BF16)
        x0 = noise - flow * t_i
        noise = (1 - t_next) * x0 + t_next * torch.randn(x0.size(), dtype=x0.dtype, device=x0.device, generator=generator)
        record.append((x_in, flow, noise.clone()))
    noise[:, : motion.shape[1]] = motion
    return noise


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--theirs", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--chunks", type=int, default=3)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--budget-s", type=float, default=420.0, help="skip the compiled timings past this")
    args = parser.parse_args()
    began = time.perf_counter()
    device = "cuda"
    results: dict = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "config": PRO.name}

    def save() -> None:
        with open(f"{args.out}/flashhead_gpu.json", "w") as f:
            json.dump(results, f, indent=2)

    state = random_checkpoint(PRO, args.seed, device)
    theirs = released_model(args.theirs, state, device)
    dit, adapter = build(PRO, state, device, BF16)
    dit32, adapter32 = build(PRO, state, device, torch.float32)
    del state
    g = torch.Generator(device).manual_seed(args.seed + 1)
    reference = torch.randn(16, 9, 64, 64, generator=g, device=device).to(BF16)
    audio_per_chunk = [torch.randn(1, 33, 5, 12, 768, generator=g, device=device).to(BF16) for _ in range(args.chunks)]

    timesteps = released_timesteps(device)
    ours_steps = chunk_timesteps(PRO).to(device)
    gen_theirs = torch.Generator(device).manual_seed(args.seed + 2)
    gen_ours = torch.Generator(device).manual_seed(args.seed + 2)
    motion_theirs = motion_ours = reference[:, :1]
    rows = []
    with torch.no_grad():
        for chunk, audio in enumerate(audio_per_chunk):
            record, ours_passes = [], []
            out_theirs = released_chunk(theirs, reference, audio, motion_theirs, gen_theirs, timesteps, record)
            tokens = adapter(audio)
            keep = lambda i, x, sink=ours_passes: sink.append(x.clone())  # noqa: E731
            out_ours = sample_chunk(dit, reference[None], tokens, motion_ours[None], gen_ours, keep)[0]
            tokens32 = adapter32(audio.float())
            for i, (x_in, flow, x_out) in enumerate(record):
                step = ours_steps[i].expand(1)
                v_ours = dit(x_in[None], reference[None], step, tokens)[0]
                v_fp32 = dit32(x_in[None].float(), reference[None].float(), step, tokens32)[0]
                rows.append({
                    "chunk": chunk, "pass": i,
                    "velocity_ours_vs_theirs": relative(v_ours, flow),
                    "velocity_theirs_vs_fp32": relative(flow, v_fp32),
                    "velocity_ours_vs_fp32": relative(v_ours, v_fp32),
                    "latents_own_trajectories": relative(ours_passes[i][0], x_out),
                })  # fmt: skip
            rows[-1]["chunk_output"] = relative(out_ours, out_theirs)
            motion_theirs, motion_ours = out_theirs[:, -2:], out_ours[:, -2:]
    results["passes"] = rows
    save()

    x = torch.randn(1, 16, 9, 64, 64, generator=g, device=device).to(BF16)
    audio = audio_per_chunk[0]
    tokens = adapter(audio)
    step = ours_steps[1].expand(1)
    timing = {}
    with torch.no_grad():
        timing["theirs_eager_ms"] = cuda_median_ms(lambda: theirs(x=x, timestep=timesteps[1], context=audio, y=reference[None]), reps=10, warmup=3)
        timing["ours_eager_ms"] = cuda_median_ms(lambda: dit(x, reference[None], step, tokens), reps=10, warmup=3)
        results["timing"] = timing
        save()
        for name, model, call in (
            ("theirs", theirs, lambda m: m(x=x, timestep=timesteps[1], context=audio, y=reference[None])),
            ("ours", dit, lambda m: m(x, reference[None], step, tokens)),
        ):
            if time.perf_counter() - began > args.budget_s:
                timing[f"{name}_compiled_ms"] = "skipped: time budget"
                continue
            compiled = torch.compile(model)
            t0 = time.perf_counter()
            call(compiled)
            torch.cuda.synchronize()
            timing[f"{name}_compile_s"] = time.perf_counter() - t0
            timing[f"{name}_compiled_ms"] = cuda_median_ms(lambda c=compiled, f=call: f(c), reps=10, warmup=3)
            save()
    timing["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9
    results["wall_s"] = time.perf_counter() - began
    save()

    print(f"{'chunk':>5} {'pass':>4} {'v ours/theirs':>13} {'v theirs/fp32':>13} {'v ours/fp32':>11} {'x own traj':>10}")
    for r in rows:
        print(f"{r['chunk']:>5} {r['pass']:>4} {r['velocity_ours_vs_theirs']:>13.4%} {r['velocity_theirs_vs_fp32']:>13.4%} "
              f"{r['velocity_ours_vs_fp32']:>11.4%} {r['latents_own_trajectories']:>10.4%}")  # fmt: skip
    print(json.dumps(timing, indent=1))


if __name__ == "__main__":
    main()
