"""Lab script (not shipped): FlashHead Pro on one GPU, our modules against the released inference code.

Both get the same seeded random weights of the real Pro config (843 tensors in the checkpoint's names),
bf16, 512x512 (9 latents of 64x64, 9,216 tokens), the same reference latent, audio features and noise
stream. Per pass: the relative difference of the velocities on the same input (each pass fed the
released model's latents), and of the latents when each side follows its own trajectory, over 3 chunks;
the same for our DiT with FP8 GEMMs (``fp8_gemms`` below: not served, its error is past the tolerance). With ``--snapshot`` each side's chunk ends as it streams: its VAE
decodes the chunk, its colour match corrects the frames, its VAE re-encodes the last 5 into the next
chunk's motion latents (the same random VAE weights on both sides; without it, the next chunk's motion
latents are the last 2 latents). Then one DiT pass's time (eager; compiled within ``--budget-s``), the
attention at a chunk's size under PyTorch's default choice and cuDNN's, and the profile of our compiled
VAE decode.

    python scripts/flashhead_gpu.py --theirs DIR --out DIR [--snapshot DIR]

DIR for --theirs holds the released ``flash_head_model.py``; for --snapshot, the repository's root (its
``flash_head/`` package, with stand-ins for the modules it imports only for multi-GPU runs).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import types
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from charstream.model.families.flashhead.colour import colour_reference, match_colours
from charstream.model.families.flashhead.config import PRO
from charstream.model.families.flashhead.loader import build, random_checkpoint
from charstream.model.families.flashhead.sampler import chunk_timesteps, sample_chunk
from charstream.model.families.flashhead.vae_wan import load_wan_vae
from charstream.model.fp8_linear import Fp8Linear
from charstream.pipeline.bench.output import cuda_median_ms

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_flashhead_vae_wan import random_wan_state  # noqa: E402

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


class BiasedFp8(torch.nn.Module):
    """A linear layer as an FP8 weight GEMM (``Fp8Linear``: e4m3 weights, a scale per output feature, a scale
    per token) plus its bf16 bias."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.gemm = Fp8Linear.from_weight(linear.weight)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemm(x) + self.bias


def fp8_gemms(dit):
    """The blocks' image-token linears (self-attention q, k, v, out; cross-attention q, out; the FFN) as FP8."""
    for block in dit.blocks:
        for attention, names in ((block.self_attn, ("to_q", "to_k", "to_v", "to_out")), (block.cross_attn, ("to_q", "to_out"))):
            for name in names:
                setattr(attention, name, BiasedFp8(getattr(attention, name)))
        block.ffn_in, block.ffn_out = BiasedFp8(block.ffn_in), BiasedFp8(block.ffn_out)
    return dit


def both_vaes(snapshot: str, seed: int, device: str) -> dict:
    """Our Wan VAE and the released one, loaded from one ``.pth`` of seeded random weights; the released
    chunk end (decode, colour match at strength 1, re-encode of the last 5 frames)."""
    sys.modules.setdefault("pyloudnorm", types.ModuleType("pyloudnorm"))
    sys.path.insert(0, snapshot)
    from flash_head.utils.utils import match_and_blend_colors_torch
    from flash_head.wan.modules import WanVAE

    path = Path("/tmp/flashhead-vae/Wan2.1_VAE.pth")
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(random_wan_state(seed), path)
    released = WanVAE(vae_path=str(path), dtype=BF16, device=device)

    def theirs_chunk_end(latents, portrait):
        videos = match_and_blend_colors_torch(released.decode(latents), portrait, 1.0)
        return videos[:, :, 5:].float(), released.encode(videos[:, :, -5:])

    return {"theirs": released, "theirs_chunk_end": theirs_chunk_end, "ours": load_wan_vae(path, device, BF16)}


def ours_chunk_end(vae, latents, colours):
    frames = vae.decode_chunk(latents[None])
    shown = match_colours(frames[:, :, 5:].float(), colours)
    return shown, vae.encode_motion(shown[:, :, -5:]).to(BF16)[0]


def attention_timing(device: str) -> dict:
    """One self-attention of a chunk (12 heads x 9,216 tokens x 128, bf16): PyTorch's default kernel choice,
    cuDNN's, and the relative difference between them."""
    g = torch.Generator(device).manual_seed(0)
    q, k, v = (torch.randn(1, 12, 9216, 128, generator=g, device=device).to(BF16) for _ in range(3))
    out = {"default_ms": cuda_median_ms(lambda: F.scaled_dot_product_attention(q, k, v), reps=20, warmup=5)}
    reference = F.scaled_dot_product_attention(q, k, v)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        out["cudnn_ms"] = cuda_median_ms(lambda: F.scaled_dot_product_attention(q, k, v), reps=20, warmup=5)
        out["cudnn_vs_default"] = relative(F.scaled_dot_product_attention(q, k, v), reference)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        out["flash_ms"] = cuda_median_ms(lambda: F.scaled_dot_product_attention(q, k, v), reps=20, warmup=5)
    return out


def vae_profile(vae, device: str) -> dict:
    """Our compiled VAE decode of one chunk (9 latents -> 33 frames): its time and its top kernels."""
    decode = torch.compile(vae.decode_chunk, dynamic=False)
    z = torch.randn(1, 16, 9, 64, 64, device=device, dtype=BF16)
    with torch.no_grad():
        ms = cuda_median_ms(lambda: decode(z), reps=5, warmup=2)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            decode(z)
            torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda e: e.device_time_total, reverse=True)
    total = sum(e.self_device_time_total for e in events)
    top = [{"kernel": e.key[:90], "calls": e.count, "ms": e.self_device_time_total / 1e3} for e in events[:15]]
    print(f"VAE decode compiled {ms:.1f} ms; kernels {total / 1e3:.1f} ms")
    for t in top:
        print(f"  {t['ms']:8.2f} ms {t['calls']:4d}x {t['kernel']}")
    return {"decode_ms": ms, "kernel_ms": total / 1e3, "top": top}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--theirs", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--chunks", type=int, default=3)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--snapshot", default=None, help="the repository's root: its VAE and colour match in the loop")
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
    dit8 = fp8_gemms(build(PRO, state, device, BF16)[0])
    dit32, adapter32 = build(PRO, state, device, torch.float32)
    del state
    g = torch.Generator(device).manual_seed(args.seed + 1)
    reference = torch.randn(16, 9, 64, 64, generator=g, device=device).to(BF16)
    audio_per_chunk = [torch.randn(1, 33, 5, 12, 768, generator=g, device=device).to(BF16) for _ in range(args.chunks)]
    vaes = None
    if args.snapshot:
        vaes = both_vaes(args.snapshot, args.seed, device)
        portrait = (torch.rand(1, 3, 1, 512, 512, generator=g, device=device) * 2 - 1).to(BF16)
        reference = vaes["theirs"].encode(portrait.repeat(1, 1, 33, 1, 1))  # (16, 9, 64, 64)
        ours_reference = vaes["ours"].encode_motion(portrait.expand(-1, -1, 33, -1, -1)).to(BF16)[0]
        results["reference_latent_ours_vs_theirs"] = relative(ours_reference, reference)
        colours = colour_reference(portrait.float())

    timesteps = released_timesteps(device)
    ours_steps = chunk_timesteps(PRO).to(device)
    gen_theirs = torch.Generator(device).manual_seed(args.seed + 2)
    gen_ours = torch.Generator(device).manual_seed(args.seed + 2)
    gen_fp8 = torch.Generator(device).manual_seed(args.seed + 2)
    motion_theirs = motion_ours = motion_fp8 = reference[:, :1]
    rows = []
    with torch.no_grad():
        for chunk, audio in enumerate(audio_per_chunk):
            record, ours_passes, fp8_passes = [], [], []
            out_theirs = released_chunk(theirs, reference, audio, motion_theirs, gen_theirs, timesteps, record)
            tokens = adapter(audio)
            keep = lambda i, x, sink=ours_passes: sink.append(x.clone())  # noqa: E731
            out_ours = sample_chunk(dit, reference[None], tokens, motion_ours[None], gen_ours, keep)[0]
            keep8 = lambda i, x, sink=fp8_passes: sink.append(x.clone())  # noqa: E731
            out_fp8 = sample_chunk(dit8, reference[None], tokens, motion_fp8[None], gen_fp8, keep8)[0]
            tokens32 = adapter32(audio.float())
            for i, (x_in, flow, x_out) in enumerate(record):
                step = ours_steps[i].expand(1)
                v_ours = dit(x_in[None], reference[None], step, tokens)[0]
                v_fp8 = dit8(x_in[None], reference[None], step, tokens)[0]
                v_fp32 = dit32(x_in[None].float(), reference[None].float(), step, tokens32)[0]
                rows.append({
                    "chunk": chunk, "pass": i,
                    "velocity_ours_vs_theirs": relative(v_ours, flow),
                    "velocity_fp8_vs_theirs": relative(v_fp8, flow),
                    "velocity_theirs_vs_fp32": relative(flow, v_fp32),
                    "velocity_ours_vs_fp32": relative(v_ours, v_fp32),
                    "velocity_fp8_vs_fp32": relative(v_fp8, v_fp32),
                    "latents_own_trajectories": relative(ours_passes[i][0], x_out),
                    "latents_fp8_own_trajectories": relative(fp8_passes[i][0], x_out),
                })  # fmt: skip
            rows[-1]["chunk_output"] = relative(out_ours, out_theirs)
            rows[-1]["chunk_output_fp8"] = relative(out_fp8, out_theirs)
            if vaes is None:
                motion_theirs, motion_ours, motion_fp8 = out_theirs[:, -2:], out_ours[:, -2:], out_fp8[:, -2:]
                continue
            shown_theirs, motion_theirs = vaes["theirs_chunk_end"](out_theirs, portrait)
            # our VAE and colour match on their latents, then each side on its own
            shown_same, _ = ours_chunk_end(vaes["ours"], out_theirs, colours)
            shown_ours, motion_ours = ours_chunk_end(vaes["ours"], out_ours, colours)
            shown_fp8, motion_fp8 = ours_chunk_end(vaes["ours"], out_fp8, colours)
            rows[-1] |= {
                "frames_same_latents": relative(shown_same, shown_theirs),
                "frames_own_trajectories": relative(shown_ours, shown_theirs),
                "frames_fp8_own_trajectories": relative(shown_fp8, shown_theirs),
                "motion_own_trajectories": relative(motion_ours, motion_theirs),
                "motion_fp8_own_trajectories": relative(motion_fp8, motion_theirs),
            }
    results["passes"] = rows
    save()
    results["attention"] = attention_timing(device)
    save()
    if vaes is not None:
        results["vae_profile"] = vae_profile(vaes["ours"], device)
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

    print(f"{'chunk':>5} {'pass':>4} {'v ours/theirs':>13} {'v fp8/theirs':>12} {'v theirs/fp32':>13} {'v ours/fp32':>11} "
          f"{'v fp8/fp32':>10} {'x own traj':>10} {'x fp8 traj':>10}")
    for r in rows:
        print(f"{r['chunk']:>5} {r['pass']:>4} {r['velocity_ours_vs_theirs']:>13.4%} {r['velocity_fp8_vs_theirs']:>12.4%} "
              f"{r['velocity_theirs_vs_fp32']:>13.4%} {r['velocity_ours_vs_fp32']:>11.4%} {r['velocity_fp8_vs_fp32']:>10.4%} "
              f"{r['latents_own_trajectories']:>10.4%} {r['latents_fp8_own_trajectories']:>10.4%}")  # fmt: skip
        ends = {k: v for k, v in r.items() if k.startswith(("frames", "motion", "chunk_output"))}
        if ends:
            print("       chunk end: " + ", ".join(f"{k} {v:.4%}" for k, v in ends.items()))
    print(json.dumps(timing | {"attention": results["attention"]}, indent=1))


if __name__ == "__main__":
    main()
