"""``charstream model info``: parameters, per-rank memory and FLOPs of a preset under tensor parallelism;
or, with ``--model``, a model family's weights folder checked against what it needs.

Counts come from the real module built on the meta device and sharded by model/tp.py (no memory
is allocated, so ``characters-57b`` is as quick as ``tiny``); FLOPs are the GEMMs and attentions of
one step (4 passes) with the window full. A family's folder is read from its file headers only.
"""

from __future__ import annotations

import argparse
import json

import torch

from charstream.model.config import PRESETS, ModelConfig, get_preset
from charstream.model.dit import DiT, step_flops
from charstream.model.families import FAMILY_NAMES, get_family
from charstream.model.families.base import CheckpointError
from charstream.model.tp import apply_tp
from charstream.timeline import CHARACTERS, Timeline


def add_arguments(parser: argparse.ArgumentParser) -> None:
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    which.add_argument("--model", choices=FAMILY_NAMES, help="a model family, with --weights")
    parser.add_argument("--weights", help="the family's weights folder as released, or 'random' (with --model)")
    parser.add_argument("--audio-encoder", help="the wav2vec2-base-960h folder, if not in or beside --weights")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks")
    parser.add_argument("--peak-tflops", type=float, metavar="TFLOPS",
                        help="an accelerator's peak rate at the model's precision (e.g. 989 for an H100 or H200 in "
                             "bf16, dense): adds the most sessions it (--tp of them, for a preset) could hold in "
                             "real time at 100%% use")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def model_report(cfg: ModelConfig, tp: int) -> dict[str, int | float | str]:
    cfg.validate(tp)
    with torch.device("meta"):
        model = DiT(cfg)
    params_total = sum(p.numel() for p in model.parameters())
    apply_tp(model, 0, tp)  # every rank holds the same amount
    params_rank = sum(p.numel() for p in model.parameters())
    block = model.blocks[0]
    heads = block.n_heads
    t, a = cfg.tokens_per_step, cfg.n_audio_tokens
    attended = (cfg.sink_frames + cfg.window_frames) * t
    passes = len(cfg.noise_levels)
    flops_rank = step_flops(model)
    kv_elements = 2 * cfg.n_blocks * heads * cfg.storage_slots * cfg.head_dim  # K and V
    return {
        "preset": cfg.name,
        "tp": tp,
        "params_total": params_total,
        "params_per_rank": params_rank,
        "param_bytes_per_rank_bf16": 2 * params_rank,
        "param_bytes_per_rank_fp8": params_rank,  # FP8 weights (+ per-row scales, negligible)
        "tokens_per_step": t,
        "video_tokens": cfg.video_tokens,
        "audio_tokens": a,
        "heads_per_rank": heads,
        "attended_slots": attended,
        "storage_slots": cfg.storage_slots,
        "kv_bytes_per_rank_bf16": 2 * kv_elements,
        "kv_bytes_per_rank_fp8": kv_elements + 2 * 4 * cfg.n_blocks * heads,  # + fp32 per-head scales
        "k_bytes_per_rank_fp8": kv_elements // 2,  # what one delta rotation touches at most
        "flops_per_step_per_rank": flops_rank,
        "flops_per_step_total": tp * flops_rank,
        "passes_per_step": passes,
        "all_reduces_per_step": passes * cfg.n_blocks if tp > 1 else 0,
        "all_reduce_bytes_bf16": 2 * t * cfg.dim,
    }


def _human(n: float, unit: str = "") -> str:
    for div, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div:
            return f"{n / div:.2f} {suffix}{unit}"
    return f"{n:g} {unit}".strip()


def compute_report(flops_per_chunk: dict[str, int], timeline: Timeline, peak_tflops: float | None,
                   accelerators: int = 1) -> dict[str, int | float]:
    """A chunk's FLOPs by part and in all, what a session costs per second of video, and with ``peak_tflops``
    the most sessions ``accelerators`` of that peak could hold in real time (every FLOP at its peak rate: an
    upper bound, never reached)."""
    total = sum(flops_per_chunk.values())
    per_second = round(total * timeline.fps / timeline.frames_per_chunk)
    report: dict[str, int | float] = {f"flops_{part}_per_chunk": n for part, n in flops_per_chunk.items()}
    report |= {"flops_per_chunk": total, "flops_per_video_second": per_second}
    if peak_tflops is not None:
        if not peak_tflops > 0:
            raise ValueError(f"--peak-tflops must be > 0, got {peak_tflops}")
        report |= {"peak_tflops": peak_tflops, "sessions_at_most": int(accelerators * peak_tflops * 1e12 // per_second)}
    return report


def family_report(name: str, weights: str, audio_encoder: str | None, peak_tflops: float | None = None) -> dict[str, object]:
    """The family's timeline, parameter count and compute, and what ``weights`` holds against what it needs."""
    family = get_family(name, **({"audio_encoder": audio_encoder} if audio_encoder else {}))
    timeline = family.timeline
    head = {
        "family": family.name,
        "generation_mode": family.generation_mode,
        "fps": timeline.fps,
        "new_frames_per_chunk": timeline.frames_per_chunk,
    }
    compute = compute_report(family.flops_per_chunk(), timeline, peak_tflops)
    if weights == "random":
        return head | {"variant": family.variant, "weights": "random (seeded)", "ok": True,
                       "params": family.parameter_count()} | compute
    return head | family.inspect(weights).as_dict() | compute


def run(args: argparse.Namespace) -> int:
    if args.model is not None:
        if args.weights is None:
            raise SystemExit("charstream model info: --model needs --weights DIR (or --weights random)")
        try:
            report = family_report(args.model, args.weights, args.audio_encoder, args.peak_tflops)
        except (CheckpointError, ValueError) as e:
            raise SystemExit(f"charstream model info: {e}") from None
        if not report["ok"]:
            if args.json:
                print(json.dumps(report, indent=2))
            raise SystemExit(f"charstream model info: {report['weights']}: {report['problem']}")
        _print(report, args.json)
        return 0
    if args.weights is not None:
        raise SystemExit("charstream model info: --weights goes with --model (a preset's weights are not checked here)")
    try:
        report = model_report(get_preset(args.preset), args.tp)
        # the step's FLOPs over every rank (its replicated parts once per rank) and its decode
        parts = get_family(args.preset).flops_per_chunk() | {"denoise": report["flops_per_step_total"]}
        report |= compute_report(parts, CHARACTERS, args.peak_tflops, args.tp)
    except ValueError as e:  # a TP size the preset's heads or FFN do not divide; a peak that is no rate
        raise SystemExit(f"charstream model info: {e}") from None
    _print(report, args.json)
    return 0


def _print(report: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(report, indent=2))
        return
    for key, value in report.items():
        if isinstance(value, int) and ("bytes" in key):
            shown = _human(value, "B")
        elif isinstance(value, int) and ("params" in key or key.startswith("flops")):
            shown = _human(value, "FLOP" if "flops" in key else "")
        elif isinstance(value, list):
            shown = f"{len(value)}" + (f" (first: {value[0]})" if value else "")
        else:
            shown = str(value)
        print(f"{key:30s} {shown}")
