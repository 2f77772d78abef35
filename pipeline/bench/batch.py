"""Cross-session batching on a GPU: one ``BatchedStep`` forward for K sessions against K separate steps
of the step that serves one session alone, and one ``BatchedDecoder`` forward for K sessions' chunks
against K separate decodes of the decoder that serves one session alone.

    charstream bench batch [--preset tiny] [--sessions 1 8 16 32 64] [--reps 30] [--json] [--out FILE]

Per K (every session past its first window, so every ring is full and attention takes the whole window):

- batched, graphed: ``BatchedStep.step`` over K sessions -- wall ms per forward (host bookkeeping of the
  K sessions, input copies, the bucket's graph replay, the latents back to the host: what the stage's
  batcher pays), GPU ms per forward (the replay alone, CUDA events), and both per session-step;
- batched, eager: the same forward without its graph (wall ms);
- separate: K x one session's serving step (``Generator``'s fused FP8 step, CUDA-graphed), timed as
  K consecutive steps each with its latent back on the host; its GPU ms is the replay alone.

The decoder, per K (each session continuing from a state of its own):

- batched, graphed: ``BatchedDecoder.decode`` of K chunks -- wall ms per forward (the latents in, the K
  states gathered, the bucket's replay, the new states copied out of the graph, the uint8 frames back
  on the host: what the decode batcher pays), GPU ms (the replay alone), both per session-chunk;
- batched, eager: the same forward without its graph (wall ms);
- separate: K x one session's serving decode (``GraphedDecoder``, bf16, one replay per chunk) with its
  frames back on the host; its GPU ms is the replay alone.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from charstream.kernels.fp8 import FP8_DTYPE
from charstream.model.batched_decoder import BatchedDecoder
from charstream.model.config import get_preset
from charstream.model.generator import Generator
from charstream.model.graphed_decoder import GraphedDecoder
from charstream.model.step import BatchedStep
from charstream.model.weights import build_model, load_decoder
from charstream.pipeline.bench.output import commit_id, cuda_median_ms, emit_report, text_table

SESSIONS = (1, 8, 16, 32, 64)


def _wall_ms(fn, reps: int) -> float:
    """Median wall time of ``fn`` (which ends synchronised with the GPU) in ms."""
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _rows(batch: BatchedStep | BatchedDecoder, forward: Callable[[int], Callable[[bool | None], object]], unit: str,
          sessions: tuple[int, ...], single_wall: float, single_gpu: float, reps: int) -> list[dict]:
    """Per K in ``sessions``: the batched forward ``forward(K)(graphed)`` timed graphed (wall, and its replay
    alone on the GPU) and eager, beside K separate ``unit``s of ``single_wall`` / ``single_gpu`` ms each."""
    rows = []
    for k in sessions:
        run = forward(k)  # its inputs sliced here, outside the timing
        wall = _wall_ms(lambda: run(None), reps)  # noqa: B023 -- called at once
        eager = _wall_ms(lambda: run(False), reps)  # noqa: B023
        gpu = cuda_median_ms(batch.graphs[batch.bucket(k)].replay, reps)
        rows.append({
            "sessions": k, "bucket": batch.bucket(k),
            "batched_wall_ms": wall, "batched_gpu_ms": gpu, "batched_eager_wall_ms": eager,
            f"batched_wall_ms_per_{unit}": wall / k, f"batched_gpu_ms_per_{unit}": gpu / k,
            "separate_wall_ms": single_wall * k, "separate_gpu_ms": single_gpu * k,
            "speedup_wall": single_wall * k / wall, "speedup_gpu": single_gpu * k / gpu,
        })
    return rows


def _table(rows: list[dict], unit: str) -> str:
    head = ["K", "batched wall ms", "GPU ms", f"GPU ms/{unit}", f"wall ms/{unit}", "eager wall ms",
            "K separate wall ms", "K separate GPU ms", "speedup wall", "speedup GPU"]
    return text_table([head] + [[str(r["sessions"]), f"{r['batched_wall_ms']:.3f}", f"{r['batched_gpu_ms']:.3f}",
                                 f"{r[f'batched_gpu_ms_per_{unit}']:.4f}", f"{r[f'batched_wall_ms_per_{unit}']:.4f}",
                                 f"{r['batched_eager_wall_ms']:.3f}", f"{r['separate_wall_ms']:.3f}",
                                 f"{r['separate_gpu_ms']:.3f}", f"{r['speedup_wall']:.1f}x", f"{r['speedup_gpu']:.1f}x"]
                                for r in rows])


def bench_batch(preset: str, sessions: tuple[int, ...], reps: int, seed: int = 0) -> dict:
    cfg = get_preset(preset)
    dev = torch.device("cuda")
    model = build_model(cfg, None, dev, torch.bfloat16, None, seed)
    g = torch.Generator().manual_seed(seed)
    reference = torch.randn(cfg.latent_channels, cfg.latent_height, cfg.latent_width, generator=g)
    audio = torch.randn(cfg.n_audio_tokens, cfg.audio_dim, generator=g)
    warm = cfg.window_frames + 2  # past the first window: full rings

    started = time.perf_counter()
    batch = BatchedStep(model, max(sessions), FP8_DTYPE)  # graphed, as served
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

    def forward(k: int) -> Callable[[bool | None], object]:
        due, tokens, seeds = steps[:k], [audio] * k, list(range(k))
        return lambda graphed: batch.step(due, tokens, seeds, graphed=graphed).cpu()

    rows = _rows(batch, forward, "step", sessions, single_wall, single_gpu, reps)
    return {
        "bench": "batch", "preset": preset, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "commit": commit_id(), "reps": reps, "capture_s": capture_s, "buckets": batch.buckets,
        "single_step": {"wall_ms": single_wall, "gpu_ms": single_gpu, "body": "fused FP8, graphed"},
        "rows": rows, "decode": bench_decode(preset, sessions, reps, seed),
    }


def bench_decode(preset: str, sessions: tuple[int, ...], reps: int, seed: int = 0) -> dict:
    cfg = get_preset(preset)
    g = torch.Generator().manual_seed(seed)
    latents = torch.randn(max(sessions), cfg.latent_channels, cfg.latent_height, cfg.latent_width, generator=g)

    started = time.perf_counter()
    batch = BatchedDecoder(load_decoder(preset, None, "cuda", torch.bfloat16, seed), max(sessions), graphed=True)
    capture_s = time.perf_counter() - started
    _, states = batch.decode(latents, [None] * len(latents))  # every session with a history of its own
    _, states = batch.decode(latents, states)

    single = GraphedDecoder(load_decoder(preset, None, "cuda", torch.bfloat16, seed), torch.bfloat16)
    _, state = single.decode_chunk(latents[0], None)

    def single_chunk() -> None:  # as the stage decodes: continuing from the state its last chunk left
        nonlocal state
        frames, state = single.decode_chunk(latents[0], state)
        frames.cpu()

    single_wall = _wall_ms(single_chunk, reps)
    single_gpu = cuda_median_ms(single.graph.replay, reps)

    def forward(k: int) -> Callable[[bool | None], object]:
        z, due = latents[:k], states[:k]
        return lambda graphed: batch.decode(z, due, graphed=graphed)[0].cpu()

    rows = _rows(batch, forward, "chunk", sessions, single_wall, single_gpu, reps)
    return {"capture_s": capture_s, "buckets": batch.buckets,
            "state_bytes_per_session": sum(c.numel() * c.element_size() for c in batch.zeros),
            "single_chunk": {"wall_ms": single_wall, "gpu_ms": single_gpu, "body": "GraphedDecoder, bf16"},
            "rows": rows}


def table(report: dict) -> str:
    s, d = report["single_step"], report["decode"]
    c = d["single_chunk"]
    return (f"{report['preset']} on {report['device']}, torch {report['torch']}, commit {report['commit']}; "
            f"one session's step ({s['body']}): {s['wall_ms']:.3f} ms wall, {s['gpu_ms']:.3f} ms GPU; "
            f"graphs for buckets {report['buckets']} captured in {report['capture_s']:.2f} s\n" + _table(report["rows"], "step")
            + f"\ndecoder: one session's chunk ({c['body']}): {c['wall_ms']:.3f} ms wall, {c['gpu_ms']:.3f} ms GPU; "
            f"graphs for buckets {d['buckets']} captured in {d['capture_s']:.2f} s; "
            f"{d['state_bytes_per_session'] / 1e6:.2f} MB of history per session state\n" + _table(d["rows"], "chunk"))


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


if __name__ == "__main__":  # runnable as a module, without the CLI's imports
    cli = argparse.ArgumentParser(prog="charstream bench batch", description=__doc__.split("\n")[0])
    add_arguments(cli)
    raise SystemExit(run(cli.parse_args()))
