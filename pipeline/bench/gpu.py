"""``charstream bench gpu``: one tensor-parallel shard of a preset on one GPU, against the reference.

Measures, for each ``--tp-shard`` size: the 4-pass diffusion step (fused kernels + FP8 GEMMs, CUDA
graph replay and eager), its per-kernel breakdown (each kernel timed alone at the step's shapes,
x 240 block-passes), cache upkeep per step, the delta rotation of the whole shard cache, the ring
attention's block-shape sweep against PyTorch's SDPA; then the full-size decoder per chunk and the
pipelined period (decoder on a second stream of the same GPU). The measured ceilings (copy
bandwidth, bf16 and FP8 GEMM rates) come first, so every figure has its fraction of them.

Timing: CUDA events around graph replays, medians (``triton.testing.do_bench`` for single kernels,
rotating over the 60 layers' weights and caches so L2 holds none of them). Random weights and a
random FP8 cache, never zeros (zeros would flatter the kernels): the step's cost does not depend on the values.
"""

from __future__ import annotations

import argparse
import bisect
import faulthandler
import functools
import json
import os
import statistics
import time
import traceback
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from charstream.model.config import ModelConfig, get_preset
from charstream.pipeline.bench.output import commit_id, cuda_median_ms, free_port, text_table
from charstream.stages.diffusion.tp_group import NO_MULTICAST
from charstream.timeline import SAMPLES_PER_CHUNK

REFERENCE = {  # docs/ARCHITECTURE.md, "Reference numbers" (4xH100) and the step's targets on one H200
    "step_ms": {3: 147.4, 4: None},
    "target_step_ms": {3: 112.0, 4: 86.0},
    "cache_upkeep_ms": 6.2,
    "delta_rotation_ms": 263.0,
    "decoder_ms": 114.0,
    "period_minus_diffusion_ms": 1.6,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="characters-57b")
    parser.add_argument("--tp-shard", type=int, nargs="+", default=[3, 4], help="TP sizes whose rank-0 shard to time")
    parser.add_argument("--json", nargs="?", const="bench_gpu.json", default=None, help="write all figures here")
    parser.add_argument("--steps", type=int, default=20, help="timed graph replays per measurement")
    parser.add_argument("--tp", type=int, default=None,
                        help="instead: a TP group of this many ranks with communication (pipeline/bench/tp.py; "
                             "NCCL over GPUs 0..N-1, gloo on CPU with a scaled model when the host has fewer GPUs)")
    parser.add_argument("--no-group", action="store_true",
                        help="time the shard's step without its all-reduces (default: in a one-rank NCCL group, "
                             "as the step serves: the collectives replay inside its graph)")
    parser.add_argument("--skip", nargs="*", default=[],
                        choices=["ceilings", "sweep", "kernels", "profile", "step", "fp8-window", "window-split",
                                 "decoder", "pipeline", "encoder"])
    parser.add_argument("--trace", action="store_true", help="with --json: also write each shard's Chrome trace of one replay")
    parser.add_argument("--section-timeout", type=float, default=0.0,
                        help="seconds a section may run before every thread's stack is printed and the process "
                             "exits (0: no limit); the JSON holds the sections finished before it")


def _bench(fn: Callable[[], object]) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def _capture(fns: list[Callable[[], object]]) -> torch.cuda.CUDAGraph:
    """``fns`` back to back in one CUDA graph, after one warm-up run on a side stream (compiles,
    allocations made outside the capture)."""
    main = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    side.wait_stream(main)
    with torch.cuda.stream(side):
        for fn in fns:
            fn()
    main.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    return graph


def _graph_ms(fns: list[Callable[[], object]], reps: int = 10) -> float:
    """Per-call GPU time of ``fns`` run back to back inside one CUDA graph (as in the step): no
    Python launch cost in the figure, activations as warm in L2 as the step leaves them."""
    return cuda_median_ms(_capture(fns).replay, reps) / len(fns)


def _graphs_ms(variants: dict[str, list[Callable[[], object]]], rounds: int = 3, reps: int = 10) -> dict[str, float]:
    """``_graph_ms`` of several variants of one kernel, each captured once, then timed in turns
    (``rounds`` x each variant's replays, the median of each variant's rounds): a difference between
    variants (what one part of a kernel adds) is not a difference between moments of the machine."""
    graphs = {name: _capture(fns) for name, fns in variants.items()}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, graph in graphs.items():
            times[name].append(cuda_median_ms(graph.replay, reps) / len(variants[name]))
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def _cycle(fns: list[Callable[[], object]]) -> Callable[[], object]:
    """One call runs the next of ``fns``: rotates over per-layer inputs so the L2 cache holds none."""
    state = {"i": 0}

    def call():
        state["i"] = (state["i"] + 1) % len(fns)
        return fns[state["i"]]()

    return call


def ceilings() -> dict[str, float]:
    n = 1 << 30
    src = torch.randn(n // 4, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = _bench(lambda: dst.copy_(src))
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    bf16_ms = _bench(lambda: a @ b)
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    sa, sb = torch.ones(8192, 1, device="cuda"), torch.ones(1, 8192, device="cuda")
    fp8_ms = _bench(lambda: torch._scaled_mm(a8, b8.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=True))
    flops = 2 * 8192**3
    return {
        "copy_tb_s": 2 * n / copy_ms / 1e9,
        "bf16_tflops": flops / bf16_ms / 1e9,
        "fp8_tflops": flops / fp8_ms / 1e9,
    }


def shard_config(cfg: ModelConfig, tp: int) -> dict[str, int]:
    return {"tp": tp, "heads": cfg.n_heads // tp, "ffn": cfg.ffn_dim // tp, "hd": cfg.n_heads // tp * cfg.head_dim}


def build_shard(cfg: ModelConfig, tp: int, seed: int = 0):
    """Rank 0's shard of ``tp`` with random weights on this GPU, and a KV cache full of random FP8
    context (sink + a full window valid). One GPU stands for one rank: no collective runs."""
    from charstream.kernels.fp8 import FP8_DTYPE
    from charstream.kernels.rope import rope_freqs
    from charstream.model.cache import KVCache
    from charstream.model.dit import DiT
    from charstream.model.tp import apply_tp

    with torch.device("meta"):
        model = DiT(cfg).to(torch.bfloat16)
    apply_tp(model, 0, tp, None)
    for block in model.blocks:
        block.w_out._forward_hooks.clear()  # the all-reduce hook: not on one GPU
    model.to_empty(device="cuda")
    model.init_random_(seed, tp_world=tp)
    model.eval().requires_grad_(False)
    freqs = rope_freqs(cfg.head_dim, "cuda")
    cache = KVCache(cfg, cfg.n_heads // tp, FP8_DTYPE, "cuda", freqs)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for t in (cache.k, cache.v):  # random codes over most of the e4m3 range, per layer (no huge temporaries)
        for layer in range(t.shape[0]):
            t[layer] = (torch.randn(t.shape[1:], device="cuda", generator=gen) * 64).clamp(-448, 448).to(FP8_DTYPE)
    cache.k_scale.uniform_(0.005, 0.02, generator=gen)
    cache.v_scale.uniform_(0.005, 0.02, generator=gen)
    cache.slot_frame = [None] * cache.ring_frames
    cache.next_frame = cfg.window_frames + 1  # steady state: the whole window is valid context
    for f in range(cache.next_frame):
        cache.slot_frame[f % cache.ring_frames] = f
    return model, cache


def step_flops(cfg: ModelConfig, tp: int) -> dict[str, float]:
    s = shard_config(cfg, tp)
    t = cfg.tokens_per_step
    gemm = 2 * t * cfg.dim * ((4 * s["hd"] + s["ffn"]) + (2 * s["hd"] + s["ffn"]))
    attended = (cfg.sink_frames + cfg.window_frames) * t
    attn = 4 * t * attended * s["hd"] + 4 * t * cfg.n_audio_tokens * s["hd"]
    passes = len(cfg.noise_levels) * cfg.n_blocks
    return {"gemm": gemm * passes, "attention": attn * passes}


def kernel_breakdown(cfg: ModelConfig, tp: int, model, cache, step) -> dict[str, object]:
    """Each kernel of a block-pass alone at the step's shapes (rotating over layers), x block-passes."""
    from charstream.kernels.adaln_quant import adaln_quant_triton
    from charstream.kernels.cross_attention import cross_attention_triton
    from charstream.kernels.delta_rotate import delta_rotate_triton
    from charstream.kernels.quantize_rows import quantize_rows_triton
    from charstream.kernels.ring_attention import gather_window, ring_attention_triton, window_attention
    from charstream.kernels.ring_write import ring_write_prep_triton, ring_write_triton, rope_table

    s = shard_config(cfg, tp)
    t, hd, heads, d = cfg.tokens_per_step, s["hd"], s["heads"], cfg.head_dim
    layers = range(cfg.n_blocks)
    passes = len(cfg.noise_levels) * cfg.n_blocks
    x = torch.randn(t, cfg.dim, device="cuda", dtype=torch.bfloat16)
    res = torch.randn_like(x)
    body, window = step.body, step.full_window.window
    mods = body.mods[0]
    fused = torch.randn(t, 4 * hd + s["ffn"], device="cuda", dtype=torch.bfloat16)
    q, k, v, cq = (fused[:, i * hd : (i + 1) * hd].unflatten(-1, (heads, d)) for i in range(4))
    hq = adaln_quant_triton(x, mods[0, 0], mods[0, 1])
    oq = quantize_rows_triton(fused[:, 2 * hd :], act_from=2 * hd)
    cache.begin_frame()
    slot = torch.tensor(cache.write_start, device="cuda")
    pos = step.positions
    rotation = rope_table(pos, cache.freqs)  # built once per step, read by every write
    win_k, win_v = window.k, window.v
    attn_args = lambda layer: (cache.k[layer], cache.v[layer], cache.k_scale[layer], cache.v_scale[layer],  # noqa: E731
                               cache.ring_valid, cache.sink_slots, cache.tokens_per_frame)
    out = torch.empty(t, heads, d, device="cuda", dtype=torch.bfloat16)
    ck = torch.randn(heads, cfg.n_audio_tokens, d, device="cuda", dtype=torch.bfloat16)
    every = [i for _ in cfg.noise_levels for i in layers]  # the step's 240 block-passes, layer by layer
    attn = torch.randn(t, hd, device="cuda", dtype=torch.bfloat16)  # the attention output as cuDNN leaves it

    def prep(i: int, write_ring: bool = True, window: bool = True) -> None:
        # as the full-window step runs it: the RoPE table, and the window copy of the written K/V
        run = ring_write_prep_triton if write_ring else prep_without_ring_write
        run(q, k, v, cq, cache.k[i], cache.v[i], cache.k_scale[i], cache.v_scale[i], slot, pos, cache.freqs,
            step.ring.write.norms[i], cache.saturated, rotation=rotation,
            window=(win_k[i], win_v[i], window.slot) if window else None)

    # The serving prep with and without its parts (timed in turns): what the FP8 ring write adds to
    # the prep is the write's cost as served -- no write has a launch of its own there.
    prep_ms = _graphs_ms({name: [lambda i=i, kw=kw: prep(i, **kw) for i in every] for name, kw in (
        ("served", {}), ("no_ring_write", {"write_ring": False}), ("no_window_copy", {"window": False}),
        ("neither", {"write_ring": False, "window": False}))})
    per_pass = {
        "adaln_quant": _graph_ms([lambda i=i: adaln_quant_triton(x, mods[i, 0], mods[i, 1], res, mods[i, 2], hq) for i in every]),
        "gemm_in": _graph_ms([lambda i=i: body.w_in[i].forward_quantized(*hq) for i in every]),
        "ring_write_prep": prep_ms["served"],
        "attention_ring_triton": _graph_ms([lambda i=i: ring_attention_triton(q, *attn_args(i), out=out, **step.ring.launch)
                                for i in every]),
        # as served: into cuDNN's own buffer (the GELU rows read the attention columns there)
        "attention_window_cudnn": _graph_ms([lambda i=i: window_attention(q, win_k[i], win_v[i]) for i in every]),
        # the window gathered from the ring at every call, then attended (what the prep's window copy saves)
        "attention_gather_then_cudnn": _graph_ms([lambda i=i: window_attention(q, *gather_window(
            cache.k[i], cache.v[i], cache.k_scale[i], cache.v_scale[i], window.frame_order, cache.sink_slots,
            cache.tokens_per_frame, (win_k[0], win_v[0])), out) for i in every]),
        "cross_attention": _graph_ms([lambda: cross_attention_triton(cq, ck, ck, out) for _ in every]),
        "quantize_rows_gelu": _graph_ms([lambda: quantize_rows_triton(fused[:, 2 * hd :], 2 * hd, oq, prefix=attn)
                                         for _ in every]),
        "gemm_out": _graph_ms([lambda i=i: body.w_out[i].forward_quantized(*oq) for i in every]),
    }
    # once per step: every block's cross K/V as served (one FP8 GEMM, one norm, views) against the module
    # body's block by block (bf16 GEMM, norm, two copies each), and how far the served K/V are from it
    context = model.audio_context(torch.randn(1, 1, cfg.n_audio_tokens, cfg.audio_dim, device="cuda",
                                              dtype=torch.bfloat16))[0, 0]
    cross_context_ms = _graphs_ms({"served": [lambda: body.cross_context(context)],
                                   "per_block_bf16": [lambda: [b.cross_context(context) for b in model.blocks]]})
    served = torch.stack([torch.stack(kv) for kv in body.cross_context(context)]).float()
    per_block = torch.stack([torch.stack(b.cross_context(context)) for b in model.blocks]).float()
    ring_write_ms = _graph_ms([lambda i=i: ring_write_triton(
        cache.k[i], cache.v[i], cache.k_scale[i], cache.v_scale[i], k, v, slot, pos, cache.freqs, rotation) for i in every])
    rope_table_ms = _graph_ms([lambda: rope_table(pos, cache.freqs)])  # once per step
    # cache upkeep: the contract's ring write each block-pass, its RoPE table once, the host
    # bookkeeping of a frame (host time, the GPU idle meanwhile), the rotation every reset_every frames
    t0 = time.perf_counter()
    for _ in range(20):
        cache.begin_frame()  # the same frame again: no end_frame, so no position reset either
    torch.cuda.synchronize()
    begin_frame_ms = (time.perf_counter() - t0) / 20 * 1e3
    # The rotation as KVCache._shift_to launches it (a host integer delta, the frame about to be
    # overwritten skipped). Timed back to back by
    # do_bench (the serving figure: the GPU time of the launch); the older figure -- CUDA events around
    # each call with a device tensor made inside the timed region, the GPU idle while the host builds
    # the tensor and Triton launches, the whole ring rotated -- is kept beside it to show what it added.
    skip = (cache.write_start, cache.tokens_per_frame)  # the frame being begun: overwritten, not rotated
    rotate = lambda: delta_rotate_triton(cache.k, cache.k_scale, -1, cache.freqs.t, cache.sink_slots, skip)  # noqa: E731
    rotate_ms = _bench(rotate)
    rotate_events_ms = cuda_median_ms(lambda: delta_rotate_triton(cache.k, cache.k_scale, torch.tensor(-1, device="cuda"),
                                                                  cache.freqs.t, cache.sink_slots), 10)
    rotate_events_back_to_back_ms = cuda_median_ms(lambda: [rotate() for _ in range(10)], 5) / 10
    k_bytes = cache.k.numel()
    frame_ms = rope_table_ms + begin_frame_ms + rotate_ms / cfg.reset_every  # the upkeep that is not the write
    marginal_ms = prep_ms["served"] - prep_ms["no_ring_write"]
    return {
        "per_block_pass_ms": per_pass,
        "per_step_ms": {name: ms * passes for name, ms in per_pass.items()},
        "ring_write_ms_per_call": ring_write_ms,
        "rope_table_ms_per_step": rope_table_ms,
        # two figures: the contract's write as a launch of its own (what the CPU path and the contract
        # call), and the write as it serves, its marginal cost inside the prep
        "cache_upkeep_contract_writes_ms_per_step": ring_write_ms * passes + frame_ms,
        "prep_variants_ms_per_call": prep_ms,
        "ring_write_marginal_in_prep_ms_per_call": marginal_ms,
        "window_copy_marginal_in_prep_ms_per_call": prep_ms["served"] - prep_ms["no_window_copy"],
        "cache_upkeep_as_served_ms_per_step": marginal_ms * passes + frame_ms,
        # the bf16 window the prep keeps beside the ring (for cuDNN) is upkeep too: with it
        "cache_upkeep_as_served_with_window_ms_per_step": (prep_ms["served"] - prep_ms["neither"]) * passes + frame_ms,
        "cross_context_ms_per_step": cross_context_ms,
        "cross_context_rel_error_fp8_vs_bf16": ((served - per_block).norm() / per_block.norm()).item(),
        "begin_frame_ms": begin_frame_ms,
        "delta_rotation_ms": rotate_ms,
        "delta_rotation_events_per_call_with_host_launch_ms": rotate_events_ms,
        "delta_rotation_events_10_back_to_back_ms": rotate_events_back_to_back_ms,
        "delta_rotation_cache_gb": k_bytes / 1e9,
    }


def graph_profile(step, path: str | None = None) -> dict[str, object]:
    """One replay of the step's graph under torch.profiler (CUPTI): every kernel's start and duration,
    so the time between kernels (the graph's launch gaps) is measured, not inferred from a sum of
    isolated timings (``trace_summary``); then the replay timed by events at the same moment; then one
    eager run of the same body with the host's operators recorded, which names the call that asks for
    each memset node the graph holds (``memset_sources``: a library's own, or one of ours).
    ``path``: also write the replay's Chrome trace there."""
    from torch.profiler import ProfilerActivity

    step.run(graphed=True)
    torch.cuda.synchronize()
    summary = trace_summary(_profiled_events(lambda: step.run(graphed=True), [ProfilerActivity.CUDA], path))
    if "error" not in summary:
        summary["replay_events_ms_same_moment"] = cuda_median_ms(lambda: step.run(graphed=True), 10)
        eager = _profiled_events(lambda: step.run(graphed=False), [ProfilerActivity.CPU, ProfilerActivity.CUDA])
        summary["eager_memset_sources"] = memset_sources(eager)
    return summary


def _profiled_events(run: Callable[[], object], activities: list, path: str | None = None) -> list[dict]:
    """The Chrome trace events of one ``run()`` under torch.profiler (written to ``path`` if given)."""
    import tempfile

    from torch.profiler import profile

    with profile(activities=activities) as prof:
        run()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        trace = path or str(Path(tmp) / "trace.json")
        prof.export_chrome_trace(trace)
        return json.loads(Path(trace).read_text()).get("traceEvents", [])


def trace_summary(events: list[dict]) -> dict[str, object]:
    """A Chrome trace of one replay: kernels by name, the gaps between consecutive kernels by boundary,
    and what the kernel span leaves out of the replay -- the graph's memcpy / memset nodes (each placed
    at the boundary of the kernels around it, with its bytes and the idle time before and after it
    there, so a gap it sits in shows), the runtime calls, and the launch call's start before the first
    kernel."""
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    if not kernels:
        return {"error": "no kernel events in the trace"}
    short = lambda e: e["name"].split("(")[0][:60]  # noqa: E731
    table = lambda: defaultdict(lambda: [0.0, 0])  # noqa: E731
    by_name, gaps, others = table(), table(), table()
    nodes: dict[str, dict[str, float]] = defaultdict(lambda: dict.fromkeys(("ms", "count", "bytes", "idle_before_us",
                                                                            "idle_after_us"), 0.0))
    busy = gap_total = 0.0
    end = kernels[0]["ts"]
    for prev, e in zip([None, *kernels[:-1]], kernels, strict=True):
        by_name[short(e)][0] += e["dur"] / 1e3
        by_name[short(e)][1] += 1
        if prev is not None:
            gap = max(0.0, e["ts"] - end)
            gap_total += gap
            key = f"{short(prev)} -> {short(e)}"
            gaps[key][0] += gap / 1e3
            gaps[key][1] += 1
        busy += max(0.0, e["ts"] + e["dur"] - max(end, e["ts"]))
        end = max(end, e["ts"] + e["dur"])
    starts = [k["ts"] for k in kernels]
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in ("gpu_memcpy", "gpu_memset", "cuda_runtime", "cuda_driver"):
            continue
        key = e["cat"] if e["cat"].startswith("gpu_") else f"{e['cat']} {e['name']}"
        others[key][0] += e.get("dur", 0) / 1e3
        others[key][1] += 1
        if e["cat"].startswith("gpu_"):  # between which kernels: the last to start before it, the next after
            i = bisect.bisect_right(starts, e["ts"])
            before = short(kernels[i - 1]) if i else "(start)"
            after = short(kernels[i]) if i < len(kernels) else "(end)"
            node = nodes[f"{e['cat']}: {before} -> {after}"]
            node["ms"] += e.get("dur", 0) / 1e3
            node["count"] += 1
            node["bytes"] += e.get("args", {}).get("bytes", 0)
            if i:
                node["idle_before_us"] += max(0.0, e["ts"] - kernels[i - 1]["ts"] - kernels[i - 1]["dur"])
            if i < len(kernels):
                node["idle_after_us"] += max(0.0, kernels[i]["ts"] - e["ts"] - e.get("dur", 0))
    launches = [e for e in events if e.get("ph") == "X" and "GraphLaunch" in e.get("name", "")]
    launch = {"graph_launch_call_us": launches[0]["dur"],
              "graph_launch_start_to_first_kernel_us": kernels[0]["ts"] - launches[0]["ts"],
              "graph_launch_start_to_last_kernel_end_ms": (end - launches[0]["ts"]) / 1e3} if launches else {}
    top = lambda d: {k: {"ms": round(v[0], 4), "count": v[1]} for k, v in sorted(d.items(), key=lambda kv: -kv[1][0])[:15]}  # noqa: E731
    per_node = {k: {"ms": round(v["ms"], 4), "count": int(v["count"]), "bytes_each": v["bytes"] / v["count"],
                    "idle_before_us_each": round(v["idle_before_us"] / v["count"], 3),
                    "idle_after_us_each": round(v["idle_after_us"] / v["count"], 3)}
                for k, v in sorted(nodes.items(), key=lambda kv: -kv[1]["ms"])}
    return {
        "kernels": len(kernels),
        "span_ms": (end - kernels[0]["ts"]) / 1e3,
        "busy_ms": busy / 1e3,
        "gaps_ms": gap_total / 1e3,
        "gap_us_per_boundary": gap_total / max(1, len(kernels) - 1),
        "kernel_ms_by_name": top(by_name),
        "gap_ms_by_boundary": top(gaps),
        "other_events_ms": top(others),
        "copy_nodes_by_boundary": per_node,
        **launch,
    }


def memset_sources(events: list[dict]) -> dict[str, dict[str, float]]:
    """An eager run's trace (host operators + CUDA): each memset the host asked for (a runtime or driver
    memset call), by the chain of operators open around the call on its thread (outermost first, the
    last three), with the bytes of the GPU memset it made -- e.g. ``aten::_scaled_mm`` alone: cuBLASLt
    asked inside the GEMM's call; a ``zero_`` / ``fill_`` of ours would be a kernel, not a memset."""
    spans = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    calls = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver")
             and "memset" in e.get("name", "").lower()]
    moved = {e["args"]["correlation"]: e["args"].get("bytes", 0) for e in events
             if e.get("cat") == "gpu_memset" and "correlation" in e.get("args", {})}
    sources: dict[str, dict[str, float]] = defaultdict(lambda: {"count": 0, "bytes": 0})
    open_ops: dict[object, list[dict]] = defaultdict(list)  # per thread: the operators around the moment swept to
    # by start; at one moment an operator before the calls inside it, the outer (longer) before the inner
    for e in sorted(spans + calls, key=lambda e: (e["ts"], e.get("cat") != "cpu_op", -e.get("dur", 0))):
        stack = open_ops[e.get("tid")]
        while stack and stack[-1]["ts"] + stack[-1]["dur"] < e["ts"]:
            stack.pop()
        if e.get("cat") == "cpu_op":
            stack.append(e)
            continue
        chain = " > ".join(op["name"] for op in stack[-3:]) or "(no operator)"
        sources[chain]["count"] += 1
        sources[chain]["bytes"] += moved.get(e.get("args", {}).get("correlation"), 0)
    return dict(sorted(sources.items(), key=lambda kv: -kv[1]["count"]))


def attention_sweep(cfg: ModelConfig, tp: int, cache) -> dict[str, float]:
    """The ring attention's block shapes against PyTorch's SDPA (bf16 K/V; and dequantize + SDPA)."""
    from charstream.kernels.ring_attention import ring_attention_reference, ring_attention_triton

    heads, t, d = cfg.n_heads // tp, cfg.tokens_per_step, cfg.head_dim
    q = torch.randn(t, heads, d, device="cuda", dtype=torch.bfloat16)
    layers = range(cfg.n_blocks)
    args = lambda i: (cache.k[i], cache.v[i], cache.k_scale[i], cache.v_scale[i], cache.ring_valid,  # noqa: E731
                      cache.sink_slots, cache.tokens_per_frame)
    result: dict[str, object] = {}
    configs = [(64, 128, 4, 2), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 4)]
    for bm, bn, warps, stages in configs:
        name = f"triton_f16_m{bm}_n{bn}_w{warps}_s{stages}"
        try:
            result[name] = _graph_ms([lambda i=i, bm=bm, bn=bn, w=warps, st=stages: ring_attention_triton(
                q, *args(i), block_m=bm, block_n=bn, num_warps=w, num_stages=st) for i in layers])
        except Exception as exc:  # a shape the compiler rejects (e.g. shared memory) is a result too
            result[name] = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
    attended = (cfg.sink_frames + cfg.window_frames) * t
    kv = [torch.randn(1, heads, attended, d, device="cuda", dtype=torch.bfloat16) for _ in range(8)]
    qh = q.transpose(0, 1)[None]
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        try:
            with sdpa_kernel(backend):
                result[f"sdpa_bf16_kv_{backend.name.lower()}"] = _graph_ms(
                    [lambda i=i: F.scaled_dot_product_attention(qh, kv[i], kv[(i + 1) % 8]) for i in range(8)])
        except Exception as exc:
            result[f"sdpa_bf16_kv_{backend.name.lower()}"] = f"failed: {type(exc).__name__}: {str(exc)[:200]}"

    def dequant_sdpa(i):
        kd = cache.k[i, :, :attended].to(torch.bfloat16) * cache.k_scale[i, :, None, None].to(torch.bfloat16)
        vd = cache.v[i, :, :attended].to(torch.bfloat16) * cache.v_scale[i, :, None, None].to(torch.bfloat16)
        return F.scaled_dot_product_attention(qh, kd[None], vd[None])

    result["dequantize_then_sdpa"] = _graph_ms([lambda i=i: dequant_sdpa(i) for i in layers])
    # accuracy of each path against fp32 math over the same stored values (one layer)
    ref = ring_attention_reference(q, *args(0)).float()
    got = ring_attention_triton(q, *args(0)).float()
    result["rel_error_f16"] = ((got - ref).norm() / ref.norm()).item()
    return result


def _best(sweep: dict[str, object], prefix: str) -> dict[str, object] | None:
    """Launch options of the fastest timed sweep entry named ``prefix``_m.._n.._w.._s.."""
    timed = [(v, n) for n, v in sweep.items() if n.startswith(prefix) and isinstance(v, float)]
    if not timed:
        return None
    m, n, w, s = (int(part[1:]) for part in min(timed)[1].split("_")[-4:])
    return {"block_m": m, "block_n": n, "num_warps": w, "num_stages": s}


def _tuned_ring(step, launch: dict[str, object]):
    """``step``'s ring backend with the attention sweep's ``launch`` options (the served kernel takes its
    defaults): a benchmark's variant, put in place of the step's before a capture."""
    from charstream.kernels.ring_attention import ring_attention_triton
    from charstream.model.step.attention import RingBackend

    class TunedRing(RingBackend):
        def forward(self, layer, q, k, v, cq, rotation):
            self.write(layer, q, k, v, cq, rotation)
            c = self.cache
            ring_attention_triton(q, *self.write.layer(layer), c.ring_valid, c.sink_slots, c.tokens_per_frame, out=v,
                                  **self.launch)
            return None, None

    ring = TunedRing(step.ring.write)
    ring.launch = launch
    return ring


def prep_without_ring_write(q, k, v, cq, k_cache, v_cache, k_scale, v_scale, slot, positions, freqs, norms, saturated,
                            rotation, window=None) -> None:
    """``ring_write_prep_triton``'s launch with the ring's stores compiled out: no serving mode, the
    measure of what the FP8 ring write adds to the prep (the write's cost as served)."""
    from charstream.kernels.ring_write import launch_ring_write

    launch_ring_write(k_cache, v_cache, k_scale, v_scale, k, v, slot, rotation, (q, cq, *norms, saturated), window,
                      8, 4, 4, True, write_ring=False)


def bench_step(cfg: ModelConfig, tp: int, reps: int, sweep: bool, group=None):
    """Build the shard, sweep the ring attention's options, then time the serving step
    (``model.step.DiffusionStep``, fused and graphed, its all-reduces in ``group``): graph replays through
    the full window (as served), through the ring with the sweep's best launch options, and once eagerly."""
    from charstream.model.step import DiffusionStep, StepOptions

    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    model, cache = build_shard(cfg, tp)
    cache.begin_frame()
    build_s = time.perf_counter() - t0
    attention = attention_sweep(cfg, tp, cache) if sweep else {}
    options = _best(attention, "triton_f16") or {}
    step = DiffusionStep(model, cache, group, StepOptions(fused=True, graphed=True, attention="gathered"))
    step.ring = _tuned_ring(step, options)
    step.set_inputs(torch.randn(cfg.n_audio_tokens, cfg.audio_dim), torch.randn(step.noise.shape), cfg.sink_frames + 7)
    if step.attention is not step.full_window:
        raise RuntimeError("the benchmark cache should hold a full window")
    _progress(f"step TP={tp}: capture (ring + gathered)")
    t0 = time.perf_counter()
    step.capture()
    capture_s = time.perf_counter() - t0
    step.attention = step.ring
    extra = {"step_graphed_ring_f16_ms": cuda_median_ms(lambda: step.run(graphed=True), reps)}
    step.attention = step.full_window
    _progress(f"step TP={tp}: gathered replays, then eager")
    graphed_ms = cuda_median_ms(lambda: step.run(graphed=True), reps)
    graphed_again_ms = cuda_median_ms(lambda: step.run(graphed=True), reps)
    eager_ms = cuda_median_ms(lambda: step.run(graphed=False), max(3, reps // 4), warmup=1)
    flops = step_flops(cfg, tp)
    result = {
        "attention_options": options,
        **extra,
        "shard": shard_config(cfg, tp),
        "tp_group": None if group is None else f"{dist.get_backend(group)}, world {dist.get_world_size(group)}",
        "build_s": build_s,
        "capture_s": capture_s,
        "step_graphed_ms": graphed_ms,
        "step_graphed_repeat_ms": graphed_again_ms,
        "step_eager_ms": eager_ms,
        "peak_memory_gb": torch.cuda.max_memory_allocated() / 1e9,
        "flops": flops,
        "achieved_tflops": (flops["gemm"] + flops["attention"]) / graphed_ms / 1e9,
        "latent_finite": bool(torch.isfinite(step.latent).all()),
    }
    return result, attention, model, cache, step


def _in_turns(runs: dict[str, Callable[[], object]], reps: int, rounds: int = 4) -> dict[str, list[float]]:
    """Each run's graph replays timed ``rounds`` times in turns, every other round in reverse order: the
    first timing after a capture or any pause runs on a GPU that idled, faster, so no variant is always
    first."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for round_ in range(rounds):
        for name in list(runs)[:: 1 if round_ % 2 == 0 else -1]:
            times[name].append(cuda_median_ms(runs[name], reps))
    return times


def bench_fp8_window(step, reps: int):
    """The serving step with the FP8 window attention (``StepOptions(attention="fp8_window")``: cuDNN's FP8
    SDPA over the ring's codes) beside ``step`` (the bf16 window, cuDNN) on the same model, cache and
    inputs: graph replays timed in turns (``_in_turns``), and how far one FP8 run's latent is
    from the bf16 run's (both from the same state: each run writes the frame it reads)."""
    from charstream.model.step import DiffusionStep, StepOptions

    fp8 = DiffusionStep(step.model, step.cache, step.tp_group, StepOptions(fused=True, attention="fp8_window"))
    fp8.set_inputs(step.audio[0, 0], step.noise, int(step.positions[0, 0]))
    if not (fp8.attention is fp8.full_window and step.attention is step.full_window):
        raise RuntimeError("both steps should attend through a full window")
    _progress("fp8 window: capture")
    fp8.capture()
    times = _in_turns({"bf16": functools.partial(step.run, graphed=True), "fp8": functools.partial(fp8.run, graphed=True)},
                      reps)
    base = step.run(graphed=True).clone()
    got = fp8.run(graphed=True).clone()
    eager = fp8.run(graphed=False).clone()
    return {
        "step_graphed_bf16_window_ms": times["bf16"],
        "step_graphed_fp8_window_ms": times["fp8"],
        "fp8_minus_bf16_ms": statistics.median(times["fp8"]) - statistics.median(times["bf16"]),
        "latent_rel_diff_fp8_vs_bf16_window": ((got - base).norm() / base.norm()).item(),
        "latent_rel_diff_graphed_vs_eager": ((got - eager).norm() / eager.norm()).item(),
        "latent_finite": bool(torch.isfinite(got).all()),
        "peak_memory_gb": torch.cuda.max_memory_allocated() / 1e9,
    }, fp8


def bench_window_split(step, reps: int) -> dict[str, object]:
    """The FP8-window step as served, its window's keys in ``step.window_splits`` partitions merged by
    their statistics, against the same model, cache and inputs in a step of one partition: graph replays
    timed in turns, and how far the one partition's latent is from the split one's."""
    from charstream.model.step import DiffusionStep, StepOptions

    one = DiffusionStep(step.model, step.cache, step.tp_group,
                        StepOptions(fused=True, attention="fp8_window", window_splits=1))
    one.set_inputs(step.audio[0, 0], step.noise, int(step.positions[0, 0]))
    _progress("window split: capture, one partition")
    one.capture()
    times = _in_turns({"split": functools.partial(step.run, graphed=True),
                       "one_partition": functools.partial(one.run, graphed=True)}, reps)
    split, whole = step.run(graphed=True).clone(), one.run(graphed=True).clone()
    return {"window_splits": step.window_splits, "step_ms": times,
            "split_minus_one_partition_ms": statistics.median(times["split"]) - statistics.median(times["one_partition"]),
            "latent_rel_diff": ((split - whole).norm() / whole.norm()).item(),
            "peak_memory_gb": torch.cuda.max_memory_allocated() / 1e9}


def bench_decoder(cfg: ModelConfig, reps: int) -> tuple[dict[str, float], object]:
    from charstream.model.graphed_decoder import GraphedDecoder
    from charstream.model.vae import Decoder, to_uint8_frames

    torch.manual_seed(0)
    shape = (cfg.latent_channels, cfg.latent_height, cfg.latent_width)
    latents = [torch.randn(shape, device="cuda") for _ in range(4)]
    result = {}
    eager32 = Decoder(cfg).cuda().eval()
    with torch.inference_mode():
        _progress("decoder: eager fp32")
        result["eager_fp32_ms"] = cuda_median_ms(_cycle([lambda z=z: to_uint8_frames(eager32.decode_chunk(z)[0]) for z in latents]),
                                             max(3, reps // 4), warmup=1)
        eager_bf16 = eager32.to(dtype=torch.bfloat16, memory_format=torch.channels_last)
        zb = [z.to(torch.bfloat16) for z in latents]
        _progress("decoder: eager bf16 channels-last")
        result["eager_bf16_channels_last_ms"] = cuda_median_ms(
            _cycle([lambda z=z: to_uint8_frames(eager_bf16.decode_chunk(z)[0]) for z in zb]), reps)
    # FLOPs of one chunk, counted by PyTorch's FLOP counter on the eager bf16 decode (convolutions and
    # matmuls: what the graphed decoder replays), so the time below has a rate beside it
    from torch.utils.flop_counter import FlopCounterMode

    with torch.inference_mode(), FlopCounterMode(display=False) as counter:
        eager_bf16.decode_chunk(zb[0])
    result["flops_per_chunk"] = float(counter.get_total_flops())
    _progress("decoder: graph capture")
    t0 = time.perf_counter()
    graphed = GraphedDecoder(Decoder(cfg).cuda())
    _progress("decoder: graph replays")
    result["capture_s"] = time.perf_counter() - t0
    result["graphed_bf16_ms"] = cuda_median_ms(_cycle([lambda z=z: graphed.decode(z) for z in latents]), reps)
    result["graphed_bf16_tflops"] = result["flops_per_chunk"] / result["graphed_bf16_ms"] / 1e9
    return result, graphed


def bench_encoder(cfg: ModelConfig, reps: int) -> dict[str, float]:
    """One chunk's audio encode as conditioning serves it (``stages.conditioning.build``'s callable:
    int16 window in, float32 tokens on the host out), eager and graphed: wall ms and host CPU ms per
    chunk (the host's share is what an engine's sessions contend for)."""
    import numpy as np

    from charstream.stages.conditioning.stage import build
    from charstream.stages.config import ConditioningConfig

    weights = "packaged" if cfg.name == "tiny" else None
    rng = np.random.default_rng(0)
    result: dict[str, float] = {}
    for mode, graphed in (("eager", False), ("graphed", True)):
        _progress(f"encoder: {mode}")
        stage = build(ConditioningConfig(device="cuda:0", graphed=graphed), cfg.name, weights)
        n = stage.context + SAMPLES_PER_CHUNK + stage.lookahead
        windows = [(rng.standard_normal(n) * 3000).astype(np.int16) for _ in range(4)]
        for w in windows:
            stage.encode(w)
        wall, cpu = [], []
        for i in range(max(20, reps)):
            t0, c0 = time.perf_counter(), time.process_time()
            stage.encode(windows[i % len(windows)])  # ends with the tokens' copy to the host: synchronised
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        result[f"{mode}_ms"] = statistics.median(wall) * 1e3
        result[f"{mode}_host_cpu_ms"] = statistics.median(cpu) * 1e3
    return result


def bench_pipeline(step, decoder, steps: int) -> dict[str, float]:
    """Step n+1 on the main stream while chunk n decodes on a second stream of the same GPU.

    ``handoff_only`` runs the same loop with the decoder's replay left out (the latent copy and the
    event hand-off stay): the period a session sees when the decoder has its own GPU, less the
    transfer between GPUs."""
    main, side = torch.cuda.current_stream(), torch.cuda.Stream()
    latent_in = decoder.latent

    def loop(decode: bool) -> float:
        done, copied = torch.cuda.Event(), torch.cuda.Event()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record(main)
        for _ in range(steps):
            step.run(graphed=True)
            done.record(main)
            with torch.cuda.stream(side):
                side.wait_event(done)
                latent_in.copy_(step.latent[0, 0])
                copied.record(side)
                if decode:
                    decoder.graph.replay()
            main.wait_event(copied)  # the next step overwrites the latent only after the hand-off copy
        end.record(main)
        torch.cuda.synchronize()
        return start.elapsed_time(end) / steps

    alone = cuda_median_ms(lambda: step.run(graphed=True), steps)
    with torch.inference_mode():
        _progress("pipeline: hand-off only")
        handoff = loop(decode=False)
        _progress("pipeline: decoder on a second stream")
        overlapped = loop(decode=True)
    return {
        "diffusion_alone_ms": alone,
        "period_handoff_only_ms": handoff,
        "period_minus_diffusion_handoff_only_ms": handoff - alone,
        "period_with_decoder_same_gpu_ms": overlapped,
        "period_minus_diffusion_same_gpu_ms": overlapped - alone,
    }


def _progress(what: str) -> None:
    print(f"[bench] {what} {time.strftime('%H:%M:%S')}", flush=True)


_SECTION_TIMEOUT_S = 0.0  # set by run(): a hung section dumps every stack and ends the process


def _section(results: dict, name: str, fn: Callable[..., object], *args):
    """Run one section with a progress line each side (flushed: the log shows where a hang is) and,
    when a limit is set, a watchdog that prints every thread's stack if it runs past it."""
    _progress(f"{name}: start")
    t0 = time.perf_counter()
    if _SECTION_TIMEOUT_S > 0:
        faulthandler.dump_traceback_later(_SECTION_TIMEOUT_S, exit=True)
    try:
        value = fn(*args)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    except Exception as exc:  # keep measuring the other sections; the failure is part of the record
        traceback.print_exc()
        results[name] = {"error": f"{type(exc).__name__}: {exc}"}
        value = None
    finally:
        faulthandler.cancel_dump_traceback_later()
    print(f"[bench] {name}: {'failed' if value is None else 'done'} in {time.perf_counter() - t0:.1f} s", flush=True)
    return value


def _save(results: dict, path: str | None) -> None:
    """Written after every section: a later hang or kill keeps what was measured."""
    if path:
        Path(path).write_text(json.dumps(results, indent=2, default=str))


def _table(results: dict) -> str:
    rows = [("figure", "measured", "target", "reference")]
    for tp, r in results.get("shards", {}).items():
        step = r.get("step", {})
        k = r.get("kernels", {})
        if "step_graphed_ms" in step:
            rows.append((f"step TP={tp} shard, graphed (ms)", f"{step['step_graphed_ms']:.1f}",
                         f"<= {REFERENCE['target_step_ms'].get(int(tp), '-')}", str(REFERENCE["step_ms"].get(int(tp)) or "-")))
            rows.append((f"step TP={tp} shard, eager (ms)", f"{step['step_eager_ms']:.1f}", "", ""))
            for key in ("step_graphed_ring_f16_ms",):
                if key in step:
                    rows.append((f"step TP={tp} {key.removeprefix('step_graphed_').removesuffix('_ms')} attention (ms)",
                                 f"{step[key]:.1f}", "", ""))
            rows.append(("  achieved TFLOP/s (GEMM+attn)", f"{step['achieved_tflops']:.0f}", "", ""))
            rows.append(("  peak memory (GB)", f"{step['peak_memory_gb']:.1f}", "", ""))
        f8 = r.get("fp8_window", {})
        if "step_graphed_fp8_window_ms" in f8:
            rows.append((f"step TP={tp}, FP8 window attention, in turns with the bf16 window (ms)",
                         ", ".join(f"{v:.1f}" for v in f8["step_graphed_fp8_window_ms"]) + " (bf16: "
                         + ", ".join(f"{v:.1f}" for v in f8["step_graphed_bf16_window_ms"]) + ")",
                         f"<= {REFERENCE['target_step_ms'].get(int(tp), '-')}", ""))
            rows.append(("  latent rel. diff FP8 vs bf16 window / graphed vs eager",
                         f"{f8['latent_rel_diff_fp8_vs_bf16_window']:.2e} / {f8['latent_rel_diff_graphed_vs_eager']:.2e}", "", ""))
            rows.append(("  peak memory with both steps built (GB)", f"{f8['peak_memory_gb']:.1f}", "", ""))
        split = r.get("window_split", {})
        if isinstance(split, dict) and "step_ms" in split:
            rows.append((f"  FP8 window in {split['window_splits']} key partitions / in one, in turns (ms); latent diff",
                         " / ".join(", ".join(f"{v:.1f}" for v in t) for t in split["step_ms"].values())
                         + f"; {split['latent_rel_diff']:.1e}", "", ""))
        for name, ms in k.get("per_step_ms", {}).items():
            rows.append((f"  {name} x{4 * 60} (ms)", f"{ms:.2f}", "", ""))
        if "cache_upkeep_as_served_ms_per_step" in k:
            rows.append((f"cache upkeep TP={tp}, as served: 240 x the write's marginal cost in the prep (ms/step)",
                         f"{k['cache_upkeep_as_served_ms_per_step']:.2f}", "<= 1", str(REFERENCE["cache_upkeep_ms"])))
            rows.append(("  same, with the bf16 window copy (ring + window writes' marginal cost)",
                         f"{k['cache_upkeep_as_served_with_window_ms_per_step']:.2f}", "", ""))
            rows.append((f"cache upkeep TP={tp}, 240 contract ring writes, a launch each (ms/step)",
                         f"{k['cache_upkeep_contract_writes_ms_per_step']:.2f}", "", ""))
            v = k["prep_variants_ms_per_call"]
            rows.append(("  prep per call (us): served / no ring write / no window copy / neither",
                         " / ".join(f"{v[n] * 1e3:.2f}" for n in ("served", "no_ring_write", "no_window_copy", "neither")),
                         "", ""))
            rows.append(("  ring write: in the prep (marginal) / contract launch (us); RoPE table, begin_frame host (us)",
                         f"{k['ring_write_marginal_in_prep_ms_per_call'] * 1e3:.2f} / {k['ring_write_ms_per_call'] * 1e3:.2f}; "
                         f"{k['rope_table_ms_per_step'] * 1e3:.1f}, {k['begin_frame_ms'] * 1e3:.0f}", "", ""))
            rows.append((f"delta rotation TP={tp}, {k['delta_rotation_cache_gb']:.2f} GB (ms)", f"{k['delta_rotation_ms']:.3f}", "<= 0.5",
                         str(REFERENCE["delta_rotation_ms"])))
            if "delta_rotation_events_10_back_to_back_ms" in k:
                rows.append(("  same, events per call with host launch / 10 back to back (ms)",
                             f"{k['delta_rotation_events_per_call_with_host_launch_ms']:.3f} / "
                             f"{k['delta_rotation_events_10_back_to_back_ms']:.3f}", "", ""))
        prof = r.get("graph_profile", {})
        if "span_ms" in prof:
            rows.append((f"  one replay TP={tp} profiled: {prof['kernels']} kernels, span / busy / gaps (ms)",
                         f"{prof['span_ms']:.1f} / {prof['busy_ms']:.1f} / {prof['gaps_ms']:.1f}", "", ""))
            for where, v in prof.get("copy_nodes_by_boundary", {}).items():  # each boundary a memset sits at
                rows.append((f"  {where}: count, ms, bytes each, idle us before / after",
                             f"{v['count']}, {v['ms']:.2f}, {v.get('bytes_each', float('nan')):.0f}, "
                             f"{v.get('idle_before_us_each', float('nan')):.2f} / {v.get('idle_after_us_each', float('nan')):.2f}",
                             "", ""))
            if "eager_memset_sources" in prof:  # none in eager while the replay holds some: asked under capture only
                nodes = sum(v["count"] for k, v in prof.get("copy_nodes_by_boundary", {}).items() if "memset" in k)
                calls = sum(v["count"] for v in prof["eager_memset_sources"].values())
                rows.append(("  memset calls of one eager run of the same body / memset nodes in the replay",
                             f"{calls} / {nodes}", "", ""))
            for chain, v in prof.get("eager_memset_sources", {}).items():  # who asks for them
                rows.append((f"  memsets of one eager run asked inside {chain}: count, bytes",
                             f"{v['count']}, {v['bytes']}", "", ""))
            if "replay_events_ms_same_moment" in prof:
                rows.append(("  replay by events, same moment / launch start -> last kernel end (ms)",
                             f"{prof['replay_events_ms_same_moment']:.1f} / "
                             f"{prof.get('graph_launch_start_to_last_kernel_end_ms', float('nan')):.1f}", "", ""))
        att = r.get("attention", {})
        if att:
            for prefix in ("triton_f16",):
                timed = [(v, n) for n, v in att.items() if isinstance(v, float) and n.startswith(prefix)]
                if timed:
                    best = min(timed)
                    rows.append((f"attention TP={tp} {best[1]} (ms)", f"{best[0]:.4f}", "", ""))
            for name, value in att.items():
                if not name.startswith("triton") and isinstance(value, float):
                    rows.append((f"attention TP={tp} {name}", f"{value:.4f}", "", ""))
    enc = results.get("encoder", {})
    if "graphed_ms" in enc:
        rows.append(("audio encode per chunk, graphed / eager: wall (ms)", f"{enc['graphed_ms']:.2f} / {enc['eager_ms']:.2f}", "", ""))
        rows.append(("  host CPU (ms)", f"{enc['graphed_host_cpu_ms']:.2f} / {enc['eager_host_cpu_ms']:.2f}", "", ""))
    dec = results.get("decoder", {})
    if "graphed_bf16_ms" in dec:
        rows.append(("decoder 704x1088 chunk, graphed bf16 (ms)", f"{dec['graphed_bf16_ms']:.2f}", "<= 40", str(REFERENCE["decoder_ms"])))
        if "graphed_bf16_tflops" in dec:
            rows.append((f"  {dec['flops_per_chunk'] / 1e12:.2f} TFLOP per chunk: achieved TFLOP/s (graphed)",
                         f"{dec['graphed_bf16_tflops']:.0f}", "", ""))
        rows.append(("decoder eager bf16 channels-last (ms)", f"{dec['eager_bf16_channels_last_ms']:.2f}", "", ""))
        rows.append(("decoder eager fp32 (ms)", f"{dec['eager_fp32_ms']:.2f}", "", ""))
    pipe = results.get("pipeline", {})
    if "period_minus_diffusion_handoff_only_ms" in pipe:
        rows.append(("period - diffusion, decoder elsewhere (ms)", f"{pipe['period_minus_diffusion_handoff_only_ms']:.3f}", "<= 0.5",
                     str(REFERENCE["period_minus_diffusion_ms"])))
        rows.append(("period - diffusion, decoder same GPU (ms)", f"{pipe['period_minus_diffusion_same_gpu_ms']:.2f}", "", ""))
    return text_table(rows)


def run(args: argparse.Namespace) -> int:
    if args.tp is not None:
        from charstream.pipeline.bench import tp as bench_tp

        args.reps = args.steps
        if args.json == "bench_gpu.json":
            args.json = "bench_tp.json"
        return bench_tp.run(args)
    if not torch.cuda.is_available():
        print("bench gpu needs a CUDA GPU")
        return 2
    import triton

    global _SECTION_TIMEOUT_S
    _SECTION_TIMEOUT_S = args.section_timeout
    cfg = get_preset(args.preset)
    results: dict[str, object] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": commit_id(),
        "preset": cfg.name,
        "reference": REFERENCE,
        "shards": {},
    }
    if "ceilings" not in args.skip:
        results["ceilings"] = _section(results, "ceilings", ceilings) or results.get("ceilings")
        _save(results, args.json)
    group = None
    if not args.no_group:
        # One GPU stands for one rank of the TP group: NCCL at world size 1 runs the step's collectives.
        os.environ.update(NO_MULTICAST)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                                device_id=torch.device("cuda:0"))
        group = dist.group.WORLD
    step = None
    for tp in args.tp_shard:
        shard: dict[str, object] = {}
        results["shards"][str(tp)] = shard
        step = None  # free the previous shard before building the next
        torch.cuda.empty_cache()
        if "step" in args.skip:
            continue
        built = _section(shard, f"step TP={tp}", bench_step, cfg, tp, args.steps, "sweep" not in args.skip, group)
        if built is None:
            continue
        shard["step"], shard["attention"], model, cache, step = built
        built = None
        if "kernels" not in args.skip:
            _save(results, args.json)
            shard["kernels"] = _section(shard, f"kernels TP={tp}", kernel_breakdown, cfg, tp, model, cache, step) or shard.get("kernels")
            per_step = shard["kernels"].get("per_step_ms") if isinstance(shard["kernels"], dict) else None
            if per_step:  # the timed step (full window) attends through the layer's window (cuDNN)
                total = sum(ms for name, ms in per_step.items()
                            if name not in ("attention_ring_triton", "attention_gather_then_cudnn"))
                shard["kernels"]["sum_of_kernels_ms"] = total
                shard["kernels"]["step_minus_sum_ms"] = shard["step"]["step_graphed_ms"] - total
        if "profile" not in args.skip:
            trace = str(Path(args.json).with_name(f"trace_tp{tp}.json")) if args.json and args.trace else None
            shard["graph_profile"] = _section(shard, f"profile TP={tp}", graph_profile, step, trace) or shard.get("graph_profile")
        if "fp8-window" not in args.skip:
            _save(results, args.json)
            built = _section(shard, f"fp8 window TP={tp}", bench_fp8_window, step, args.steps)
            if built is not None:
                shard["fp8_window"], fp8_step = built
                if "profile" not in args.skip:
                    shard["graph_profile_fp8_window"] = _section(shard, f"profile fp8 window TP={tp}", graph_profile,
                                                                 fp8_step, None) or shard.get("graph_profile_fp8_window")
                if "window-split" not in args.skip and fp8_step.window_splits > 1:
                    shard["window_split"] = _section(shard, f"window split TP={tp}", bench_window_split, fp8_step,
                                                     args.steps) or shard.get("window_split")
                fp8_step = built = None
        print(json.dumps({tp: shard}, default=str)[:3000], flush=True)
        _save(results, args.json)
        model = cache = None
    if "encoder" not in args.skip:
        results["encoder"] = _section(results, "encoder", bench_encoder, cfg, args.steps) or results.get("encoder")
        _save(results, args.json)
    if "decoder" not in args.skip:
        built = _section(results, "decoder", bench_decoder, cfg, args.steps)
        if built is not None:
            results["decoder"], decoder = built
            _save(results, args.json)
            if step is not None and "pipeline" not in args.skip:
                results["pipeline"] = _section(results, "pipeline", bench_pipeline, step, decoder, args.steps) or results.get("pipeline")
    print(_table(results), flush=True)
    _save(results, args.json)
    if group is not None:
        dist.destroy_process_group()
    if args.json:
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    import sys

    from charstream.pipeline.cli import main

    sys.exit(main(["bench", "gpu", *sys.argv[1:]]))
