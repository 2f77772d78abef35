"""Cross-session batching of the diffusion step on a GPU: one ``BatchedStep`` forward for K sessions
against K separate steps of the step that serves one session today.

    charstream bench batch [--preset tiny] [--sessions 1 8 16 32 64] [--reps 30] [--json] [--out FILE]

Per K (every session past its first window, so every ring is full and attention takes the whole window):

- batched, graphed: ``BatchedStep.step`` over K sessions -- wall ms per forward (host bookkeeping of the
  K sessions, input copies, the bucket's graph replay, the latents back to the host: what the stage's
  batcher pays), GPU ms per forward (the replay alone, CUDA events), and both per session-step;
- batched, eager: the same forward without its graph (wall ms);
- separate: K x one session's serving step (``Generator``'s fused FP8 step, CUDA-graphed), timed as
  K consecutive steps each with its latent back on the host; its GPU ms is the replay alone.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from charstream.kernels.fp8 import FP8_DTYPE
from charstream.model.config import get_preset
from charstream.model.generator import Generator
from charstream.model.step import BatchedStep
from charstream.model.weights import build_model
from charstream.pipeline.bench_output import commit_id, cuda_median_ms, emit_report, text_table

SESSIONS = (1, 8, 16, 32, 64)


def _wall_ms(fn, reps: int) -> float:
    """Median wall time of ``fn`` (which ends synchronised with the GPU) in ms."""
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def bench_batch(preset: str, sessions: tuple[int, ...], reps: int, seed: int = 0) -> dict:
    cfg = get_preset(preset)
    dev = torch.device("cuda")
    model = build_model(cfg, None, dev, torch.bfloat16, None, seed)
    g = torch.Generator().manual_seed(seed)
    reference = torch.randn(cfg.latent_channels, cfg.latent_height, cfg.latent_width, generator=g)
    audio = torch.randn(cfg.n_audio_tokens, cfg.audio_dim, generator=g)
    warm = cfg.window_frames + 2  # past the first window: full rings

    started = time.perf_counter()
    batch = BatchedStep(model, max(sessions), FP8_DTYPE, graphed=True)
    capture_s = time.perf_counter() - started
    steps = [batch.open() for _ in range(max(sessions))]
    for step in steps:
        step.reset_session(reference)
    for _ in range(warm):
        batch.step(steps, [audio] * len(steps), list(range(len(steps))))

    single = Generator(cfg, None, dev, dtype=torch.bfloat16, fp8_cache=True, seed=seed)  # fused, graphed
    single.reset_session(reference)
    for i in range(warm):
        single.step(audio, i)
    single_wall = _wall_ms(lambda: single.step(audio, 0).cpu(), reps)
    single_gpu = cuda_median_ms(single.diffusion.run, reps)

    rows = []
    for k in sessions:
        due, tokens, seeds = steps[:k], [audio] * k, list(range(k))
        graph = batch.graphs[batch.bucket(k)]
        wall = _wall_ms(lambda: batch.step(due, tokens, seeds).cpu(), reps)  # noqa: B023 -- called at once
        eager = _wall_ms(lambda: batch.step(due, tokens, seeds, graphed=False).cpu(), reps)  # noqa: B023
        gpu = cuda_median_ms(graph.replay, reps)
        rows.append({
            "sessions": k, "bucket": batch.bucket(k),
            "batched_wall_ms": wall, "batched_gpu_ms": gpu, "batched_eager_wall_ms": eager,
            "batched_wall_ms_per_step": wall / k, "batched_gpu_ms_per_step": gpu / k,
            "separate_wall_ms": single_wall * k, "separate_gpu_ms": single_gpu * k,
            "speedup_wall": single_wall * k / wall, "speedup_gpu": single_gpu * k / gpu,
        })
    return {
        "bench": "batch", "preset": preset, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "commit": commit_id(), "reps": reps, "capture_s": capture_s, "buckets": batch.buckets,
        "single_step": {"wall_ms": single_wall, "gpu_ms": single_gpu, "body": "fused FP8, graphed"},
        "rows": rows,
    }


def table(report: dict) -> str:
    head = ["K", "batched wall ms", "GPU ms", "GPU ms/step", "wall ms/step", "eager wall ms",
            "K separate wall ms", "K separate GPU ms", "speedup wall", "speedup GPU"]
    rows = [head] + [[str(r["sessions"]), f"{r['batched_wall_ms']:.3f}", f"{r['batched_gpu_ms']:.3f}",
                      f"{r['batched_gpu_ms_per_step']:.4f}", f"{r['batched_wall_ms_per_step']:.4f}",
                      f"{r['batched_eager_wall_ms']:.3f}", f"{r['separate_wall_ms']:.3f}",
                      f"{r['separate_gpu_ms']:.3f}", f"{r['speedup_wall']:.1f}x", f"{r['speedup_gpu']:.1f}x"]
                     for r in report["rows"]]
    s = report["single_step"]
    return (f"{report['preset']} on {report['device']}, torch {report['torch']}, commit {report['commit']}; "
            f"one session's step ({s['body']}): {s['wall_ms']:.3f} ms wall, {s['gpu_ms']:.3f} ms GPU; "
            f"graphs for buckets {report['buckets']} captured in {report['capture_s']:.2f} s\n" + text_table(rows))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--sessions", type=int, nargs="+", default=list(SESSIONS), help="batch sizes K")
    parser.add_argument("--reps", type=int, default=30, help="timed forwards per figure")
    parser.add_argument("--json", action="store_true", help="JSON on stdout (the table goes to stderr)")
    parser.add_argument("--out", help="also write the JSON to this file")


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        raise SystemExit("charstream bench batch needs a CUDA GPU")
    if args.reps < 1 or min(args.sessions) < 1:
        raise ValueError("--reps and every --sessions value must be >= 1")
    report = bench_batch(args.preset, tuple(args.sessions), args.reps)
    emit_report(report, table(report), args.out, args.json)
    return 0


if __name__ == "__main__":  # the device runs it without the CLI's imports
    cli = argparse.ArgumentParser(prog="charstream bench batch", description=__doc__.split("\n")[0])
    add_arguments(cli)
    raise SystemExit(run(cli.parse_args()))
