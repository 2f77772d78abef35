"""``charstream bench chunk``: a chunk-motion model's (FlashHead's) whole chunk through the objects that serve it.

One chunk is what the stages do for it, in order: the conditioning stage's encode of the 8 s audio window
(wav2vec2 + adapter, tokens to the host), the diffusion stage's ``denoise`` (4 DiT passes) and the decode
stage's ``decode`` (the VAE decode of 33 frames, the colour match and re-encode of the last 5 into the next
chunk's motion latents, the 28 new frames to the host as uint8; ``decode_lead``, of a model that decodes in
two parts: until its first new frames are on the host). Each part is timed as the stage sees it:
it returns once its session's CUDA stream is done (tokens and frames on the host, latents complete), over
``--chunks`` chunks after ``--warmup`` (the first calls compile).

Then sessions side by side: K chunk streams sharing the process's model, each on a thread of its own as
the stages run them, chunk after chunk for ``--seconds`` after one untimed chunk on that thread. Each K
runs each way asked for, in the same process (``--modes``): ``threads``, each session's chunk on its own
stream (``batch_sessions`` 1); ``batched``, the sessions' due windows encoded, and their chunks denoised
and decoded, together by the stages' batchers (``stages/conditioning/batcher.py``,
``stages/shared/chunk_batcher.py``, ``batch_sessions`` K; on CUDA the chunk batchers' threads first run a
batch of each size and capture its CUDA graph, as served); ``chunks``, the same but each session encoding its
own windows (what batching the encodes gains); ``ungraphed``, ``batched`` without the CUDA graphs (what they
gain). A session
keeps up when its chunks come at least as fast as they play (28 frames at 25 fps: one every 1.12 s); the
report gives each K's per-session chunk period (median, p90), the frames a second generated in all and
how long a session waits for each part of its chunk. Each part's rate in TFLOP/s is the family's count of its
work (``ModelFamily.flops_per_chunk``, as ``charstream model info`` prints it) over its median time, and each
K's the model's work done per second: set beside the accelerator's peak, how much of it a chunk uses.
This is the model's side of capacity (no WebRTC, no playout): the sessions a GPU can feed.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import threading
import time
from dataclasses import dataclass

import numpy as np

from charstream.model.families import FLASHHEAD_NAMES
from charstream.pipeline.arguments import add_size_arguments, sized_family
from charstream.pipeline.bench.output import commit_id, emit_report, text_table
from charstream.stages.conditioning.batcher import EncodeBatcher
from charstream.stages.shared.chunk_batcher import ChunkDecodeBatcher, ChunkDenoiseBatcher
from charstream.timeline import TIMELINE_RATE


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="flashhead-pro", choices=FLASHHEAD_NAMES)
    parser.add_argument("--weights", default="random", help="a released weights folder, or 'random' (seeded)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--chunks", type=int, default=10, help="timed chunks of the one-session run")
    parser.add_argument("--warmup", type=int, default=2, help="chunks before timing (the first compile)")
    parser.add_argument("--sessions", default="1,2,3", help="comma-separated session counts run side by side")
    parser.add_argument("--seconds", type=float, default=20.0, help="how long each session count runs")
    parser.add_argument("--modes", default="threads,batched",
                        help="comma-separated: threads (a stream per session), batched (the stages' batchers), "
                             "chunks (the chunk batchers, each session's own encodes), ungraphed (batched "
                             "without CUDA graphs)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="torch.compile the DiT and the VAE (default: on CUDA, as served)")
    add_size_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the report as JSON (the table goes to stderr)")
    parser.add_argument("--out", default=None, help="also write the JSON report here")


class Session:
    """One session's conditioner and chunk stream, fed a rolling window of speech-like noise."""

    def __init__(self, family, weights: str, device: str, index: int, compiled: bool | None) -> None:
        """Session ``index``'s own portrait and speech; the model's seed is every session's (one model)."""
        cfg = family.config
        portrait = np.random.default_rng(index).integers(0, 256, (cfg.height, cfg.width, 3), dtype=np.uint8)
        self.stream = family.chunk_stream(weights, portrait, device, 0, compiled)
        self.encode = family.audio_conditioner(weights, device, 0).encode
        self.rng = np.random.default_rng(index + 1)
        self.window = np.zeros(cfg.audio_context_s * TIMELINE_RATE, np.int16)
        self.hop = family.timeline.samples_per_chunk
        self.chunk = 0

    def next_window(self) -> np.ndarray:
        new = (self.rng.standard_normal(self.hop) * 3000).astype(np.int16)
        self.window = np.concatenate([self.window[self.hop:], new])
        return self.window

    def run_chunk(self, batchers: Batchers | None = None) -> dict[str, float]:
        """One chunk, part by part: seconds for encode, denoise and decode (by the ``batchers``, if given)."""
        t0 = time.perf_counter()
        if batchers is None or batchers.encode is None:
            tokens = self.encode(self.next_window())
        else:
            tokens = batchers.encode.enqueue(self, self.next_window()).result()
        t1 = time.perf_counter()
        if batchers is None:
            latents = self.stream.denoise(tokens, self.chunk)
        else:
            self.stream.ready(self.chunk)
            latents = batchers.denoise.enqueue(self.stream, tokens).result()
        t2 = time.perf_counter()
        handed: list[float] = []  # when the first frames were on the host (a model that decodes in two parts)

        def lead(frames: np.ndarray) -> None:
            handed.append(time.perf_counter())

        if batchers is None:
            frames = self.stream.decode(latents, lead)
        else:
            frames = batchers.decode.enqueue(self.stream, (latents, lead)).result()
        t3 = time.perf_counter()
        assert frames.dtype == np.uint8  # on the host: the decode's copy is inside the timing
        self.chunk += 1
        times = {"encode": t1 - t0, "denoise": t2 - t1, "decode": t3 - t2, "chunk": t3 - t0}
        if handed:  # the decode's part before a turn's first frames can show
            times["decode_lead"] = handed[0] - t2
        return times


def part_flops(flops_per_chunk: dict[str, int]) -> dict[str, int]:
    """The family's FLOPs of a chunk by the bench's parts: the decode part holds the motion re-encode too."""
    f = flops_per_chunk
    return {"encode": f["audio_encode"], "denoise": f["denoise"], "decode": f["decode"] + f["motion_encode"],
            "chunk": sum(f.values())}


def one_session(session: Session, chunks: int, warmup: int, flops: dict[str, int]) -> dict:
    """Each part's median, min and max ms over ``chunks`` after ``warmup``, and its TFLOP/s (of ``flops``, by part)."""
    for _ in range(warmup):
        session.run_chunk()
    runs = [session.run_chunk() for _ in range(chunks)]
    parts = {}
    for part in runs[0]:
        median = statistics.median(r[part] for r in runs)
        parts[part] = {"median_ms": 1e3 * median, "min_ms": 1e3 * min(r[part] for r in runs),
                       "max_ms": 1e3 * max(r[part] for r in runs)}
        if part in flops:
            parts[part]["tflops"] = flops[part] / median / 1e12
    return parts


@dataclass
class Batchers:
    """The stages' batchers of a chunk model, as a serving process with ``batch_sessions`` K makes them."""

    encode: EncodeBatcher | None  # None: each session encodes its own windows
    denoise: ChunkDenoiseBatcher
    decode: ChunkDecodeBatcher

    @classmethod
    def make(cls, family, weights: str, device: str, sessions: int, compiled: bool, encodes: bool = True,
             graphed: bool = True) -> Batchers:
        from charstream.stages.config import ConditioningConfig, DecodeConfig, DiffusionConfig

        def runner():
            return family.chunk_runner(weights, device, 0, compiled, batched=True, graphed=graphed)

        conditioner = family.audio_conditioner(weights, device, 0)
        encode = EncodeBatcher(ConditioningConfig(device=device, batch_sessions=sessions), conditioner, family.timeline)
        batchers = cls(encode if encodes else None,
                       ChunkDenoiseBatcher(DiffusionConfig(device=device, batch_sessions=sessions), runner()),
                       ChunkDecodeBatcher(DecodeConfig(device=device, batch_sessions=sessions), runner()))
        for _ in range(sessions):
            if batchers.encode is not None:
                batchers.encode.opened()
            batchers.denoise.opened()
            batchers.decode.opened()
        return batchers

    def close(self, sessions: list[Session]) -> None:
        for s in sessions:
            if self.encode is not None:
                self.encode.closed(s)
            self.denoise.closed(s.stream)
            self.decode.closed(s.stream)


def side_by_side(sessions: list[Session], seconds: float, chunk_s: float, frames_per_chunk: int,
                 batchers: Batchers | None = None, mode: str = "threads") -> dict:
    """Every session on its own thread, chunk after chunk, for ``seconds``: per-session periods; with
    ``batchers``, the sessions' chunks through them."""
    periods: list[list[float]] = [[] for _ in sessions]
    parts: list[dict[str, float]] = []
    ended = [0.0] * len(sessions)
    start = threading.Barrier(len(sessions) + 1)
    stop = float("inf")  # set once every thread has run its first chunk

    errors: list[BaseException] = []

    def loop(i: int) -> None:
        try:
            # one chunk first, untimed: cuDNN's benchmark cache is per thread (PyTorch keeps its conv plans
            # thread-local), so a thread's first decode re-times every convolution, as a stage thread's does once
            sessions[i].run_chunk(batchers)
            start.wait()
            last = time.perf_counter()
            while last < stop:
                parts.append(sessions[i].run_chunk(batchers))
                now = time.perf_counter()
                periods[i].append(now - last)
                last = now
            ended[i] = last
        except BaseException as e:  # noqa: BLE001 -- re-raised by the caller; the others stop waiting for it
            errors.append(e)
            start.abort()

    threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(len(sessions))]
    for t in threads:
        t.start()
    try:
        start.wait()  # every thread has run its first chunk
    except threading.BrokenBarrierError:
        pass
    began = time.perf_counter()
    stop = began + seconds
    for t in threads:
        t.join()
    failed = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
    if failed:
        raise RuntimeError(f"a session's chunk failed ({len(failed)} of {len(sessions)} sessions)") from failed[0]
    every = [p for ps in periods for p in ps]
    p90 = [float(np.percentile(ps, 90)) for ps in periods]
    return {
        "mode": mode,
        "sessions": len(sessions),
        "chunks": len(every),
        "period_median_ms": 1e3 * statistics.median(every),
        "period_p90_worst_session_ms": 1e3 * max(p90),
        "generated_fps": frames_per_chunk * len(every) / (max(ended) - began),
        "keeps_up": max(p90) <= chunk_s,
        "largest_batch": None if batchers is None else batchers.denoise.stats.largest,
        # as a session waits for each: its encode, its chunk's denoising (in a batch: the batch's), its decode
        "part_median_ms": {part: 1e3 * statistics.median(p[part] for p in parts) for part in ("encode", "denoise", "decode")},
    }


def measure(args: argparse.Namespace) -> dict:
    import torch

    family = sized_family(args.model, args.blocks, args.size, args.vae_width)
    cfg = family.config
    chunk_s = family.timeline.chunk_seconds
    began = time.perf_counter()
    first = Session(family, args.weights, args.device, 0, args.compile)
    load_s = time.perf_counter() - began
    flops = part_flops(family.flops_per_chunk())
    parts = one_session(first, args.chunks, args.warmup, flops)
    print(f"one session: chunk median {parts['chunk']['median_ms']:.1f} ms", file=sys.stderr, flush=True)
    counts = [int(k) for k in args.sessions.split(",") if k.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - {"threads", "batched", "chunks", "ungraphed"}:
        raise ValueError(f"--modes: threads, batched, chunks and/or ungraphed, got {args.modes!r}")
    streams = [first]
    ladder = []
    warmed = False
    for k in counts:
        while len(streams) < k:
            streams.append(Session(family, args.weights, args.device, len(streams), args.compile))
            streams[-1].run_chunk()  # its first calls through the compiled code, one session at a time
        for mode in modes if k > 1 else [m for m in modes if m == "threads"]:  # a batch of one is a stream alone
            if mode != "threads" and first.stream.compiled and not warmed:
                # as a serving process does before its first session: torch.compile's tracing is not
                # thread-safe (a compiled call on one thread fails while another thread compiles)
                family.warm_up(args.weights, args.device, 0, batched=True)
                warmed = True
            batchers = None if mode == "threads" else \
                Batchers.make(family, args.weights, args.device, k, first.stream.compiled, encodes=mode != "chunks",
                              graphed=mode != "ungraphed")
            ladder.append(side_by_side(streams[:k], args.seconds, chunk_s, cfg.new_frames_per_chunk, batchers, mode))
            ladder[-1]["model_tflops"] = ladder[-1]["generated_fps"] / cfg.new_frames_per_chunk * flops["chunk"] / 1e12
            print(ladder_line(ladder[-1]), file=sys.stderr, flush=True)  # a long ladder's rows as they come
            if batchers is not None:
                batchers.close(streams[:k])
    return {
        "model": args.model, "weights": args.weights, "device": args.device,
        "gpu": torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else platform.processor(),
        "torch": torch.__version__, "commit": commit_id(), "compiled": first.stream.compiled,
        "size": [cfg.height, cfg.width], "blocks": cfg.n_blocks, "vae_width": cfg.vae_width, "new_frames_per_chunk": cfg.new_frames_per_chunk,
        "fps": cfg.fps, "chunk_seconds": chunk_s, "first_session_load_s": load_s, "flops_per_chunk": flops,
        "one_session": parts, "side_by_side": ladder,
        "peak_memory_gib": torch.cuda.max_memory_allocated(args.device) / 2**30 if args.device.startswith("cuda") else None,
    }


def ladder_line(r: dict) -> str:
    return (f"{r['sessions']} sessions, {r['mode']}: {r['chunks']} chunks, period median "
            f"{r['period_median_ms']:.0f} ms, worst p90 {r['period_p90_worst_session_ms']:.0f} ms, "
            f"{r['generated_fps']:.1f} generated fps ({r['model_tflops']:.3g} TFLOP/s), keeps up {r['keeps_up']}; "
            f"a session waits for encode / "
            f"denoise / decode {part_waits(r)} ms")


def part_waits(r: dict) -> str:
    """A ladder row's median waits for encode / denoise / decode, in ms."""
    return " / ".join(f"{v:.0f}" for v in r["part_median_ms"].values())


def table(report: dict) -> str:
    rows = [["part of a chunk", "median ms", "min", "max", "TFLOP/s"]]
    for part, t in report["one_session"].items():
        rate = f"{t['tflops']:.3g}" if "tflops" in t else "-"
        rows.append([part, f"{t['median_ms']:.1f}", f"{t['min_ms']:.1f}", f"{t['max_ms']:.1f}", rate])
    chunk_ms = report["one_session"]["chunk"]["median_ms"]
    lines = [text_table(rows),
             f"one session: {report['new_frames_per_chunk'] / chunk_ms * 1e3:.1f} generated fps "
             f"({report['chunk_seconds'] * 1e3 / chunk_ms:.2f}x real time at {report['fps']} fps)", ""]
    rows = [["sessions", "mode", "chunks", "period median ms", "worst session p90 ms", "generated fps", "TFLOP/s",
             "keeps up", "largest batch", "encode / denoise / decode ms"]]
    for r in report["side_by_side"]:
        rows.append([str(r["sessions"]), r["mode"], str(r["chunks"]), f"{r['period_median_ms']:.0f}",
                     f"{r['period_p90_worst_session_ms']:.0f}", f"{r['generated_fps']:.1f}",
                     f"{r['model_tflops']:.3g}", str(r["keeps_up"]),
                     "-" if r["largest_batch"] is None else str(r["largest_batch"]),
                     part_waits(r)])
    lines += [text_table(rows),
              f"{report['model']} ({report['weights']} weights), {report['size'][0]}x{report['size'][1]}, "
              f"{report['blocks']} blocks, compiled {report['compiled']}, on {report['gpu']}; torch {report['torch']}, "
              f"commit {report['commit']}"]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> None:
    report = measure(args)
    emit_report(report, table(report), args.out, args.json)
