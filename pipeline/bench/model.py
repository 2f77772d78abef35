"""``charstream bench model``: CPU (or GPU) time of one diffusion step and one chunk decode.

A step is the 4 sampler passes of one latent frame through the DiT with the KV ring cache in steady
state (window full, positions resetting on schedule); a decode turns that latent frame into its 4
RGB frames with the streaming VAE decoder. Both are timed over ``--steps`` iterations after
``--warmup``; the report gives median and p90 and the share of the 166.7 ms chunk period they use.
Weights: the packaged ones when present, else seeded random (timing does not depend on values).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

from charstream.model.config import PRESETS, get_preset
from charstream.pipeline.bench.output import commit_id, emit_report
from charstream.timeline import CHUNK_SECONDS

BUDGET_MS = CHUNK_SECONDS * 1000.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    parser.add_argument("--steps", type=int, default=20, help="timed iterations (>= 20 for the record)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--fp8-cache", action=argparse.BooleanOptionalAction, default=False,
                        help="FP8 e4m3 KV cache (default off on CPU, as the demo runs)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON (the table goes to stderr)")
    parser.add_argument("--out", default="bench-model.json", help="also write the JSON report here")


def _quantiles(seconds: list[float], cpu_seconds: list[float] | None = None) -> dict[str, float]:
    ms = sorted(s * 1000.0 for s in seconds)
    q = {"median_ms": statistics.median(ms), "p90_ms": ms[min(len(ms) - 1, int(0.9 * len(ms)))], "min_ms": ms[0]}
    if cpu_seconds:
        # process CPU time (all threads): unlike wall time, not inflated by waiting for a busy machine's cores
        q["cpu_median_ms"] = statistics.median(s * 1000.0 for s in cpu_seconds)
    return q


def time_steps(preset: str, steps: int, warmup: int, device: str, fp8_cache: bool) -> tuple[list[float], list[float]]:
    """Wall and process-CPU seconds per ``Generator.step`` in steady state."""
    import torch

    from charstream.model.generator import Generator
    from charstream.model.weights import packaged_weights

    cfg = get_preset(preset)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    gen = Generator(cfg, packaged_weights(preset), device, dtype=dtype, fp8_cache=fp8_cache)
    g = torch.Generator().manual_seed(0)
    gen.reset_session(torch.randn(cfg.latent_channels, cfg.latent_height, cfg.latent_width, generator=g))
    audio = torch.randn(cfg.n_audio_tokens, cfg.audio_dim, generator=g)
    for i in range(cfg.window_frames):  # fill the window: steady-state attention cost
        gen.step(audio, seed=i)
    times, cpu_times = [], []
    for i in range(warmup + steps):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0, c0 = time.perf_counter(), time.process_time()
        gen.step(audio, seed=i)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            cpu_times.append(time.process_time() - c0)
    return times, cpu_times


def bench_model(preset: str, steps: int, warmup: int, device: str, fp8_cache: bool) -> dict:
    import torch

    from charstream.model.vae import time_decode

    cfg = get_preset(preset)
    step = _quantiles(*time_steps(preset, steps, warmup, device, fp8_cache))
    decode = _quantiles(time_decode(cfg, steps, warmup, device, torch.bfloat16 if device.startswith("cuda") else torch.float32))
    total = step["median_ms"] + decode["median_ms"]
    return {
        "preset": preset,
        "device": device,
        "fp8_cache": fp8_cache,
        "steps": steps,
        "passes_per_step": len(cfg.noise_levels),
        "step": step,
        "decode": decode,
        "step_plus_decode_median_ms": total,
        "budget_ms": BUDGET_MS,
        "budget_fraction": total / BUDGET_MS,
        "threads": torch.get_num_threads(),
        "load_average_1m": os.getloadavg()[0],  # > cpu_count: other work shared the cores
        "cpu_count": os.cpu_count(),
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "commit": commit_id(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def table(r: dict) -> str:
    rows = [
        f"bench model: preset {r['preset']} on {r['device']} ({r['threads']} threads), fp8 cache {r['fp8_cache']}, "
        f"{r['steps']} timed steps, torch {r['torch']}, commit {r['commit']}",
        f"{'':24s}{'median ms':>12s}{'p90 ms':>10s}{'of budget':>11s}",
    ]
    for name, key in (("step (4 passes)", "step"), ("decode (4 frames)", "decode")):
        q = r[key]
        rows.append(f"{name:24s}{q['median_ms']:12.2f}{q['p90_ms']:10.2f}{q['median_ms'] / r['budget_ms']:10.1%}")
    rows.append(f"{'step + decode':24s}{r['step_plus_decode_median_ms']:12.2f}{'':10s}{r['budget_fraction']:10.1%}"
                f"   (budget {r['budget_ms']:.1f} ms per chunk)")
    rows.append(f"step process CPU time median {r['step']['cpu_median_ms']:.2f} ms; "
                f"load average {r['load_average_1m']:.1f} on {r['cpu_count']} CPUs")
    return "\n".join(rows)


def run(args: argparse.Namespace) -> int:
    if args.steps < 1 or args.warmup < 0:
        raise SystemExit("charstream bench model: --steps must be >= 1 and --warmup >= 0")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    report = bench_model(args.preset, args.steps, args.warmup, args.device, args.fp8_cache)
    emit_report(report, table(report), args.out, args.json)
    return 0
