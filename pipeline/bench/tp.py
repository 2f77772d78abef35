"""``charstream bench gpu --tp N``: a tensor-parallel group of N ranks, communication included.

One process per rank (NCCL on GPUs ``cuda:0..N-1``; gloo on CPU when the host has fewer GPUs, with
a smaller model so it finishes). Measured at the production row count (``tokens_per_step``):
- the all-reduce of one block's output (rows x dim), per call;
- the row-parallel output GEMM alone, and GEMM then all-reduce, in the same run;
- the whole 4-pass step on every rank, communication included: the serving ``DiffusionStep`` (on
  GPUs the fused FP8 body as CUDA graphs, NCCL inside them), and the module body eagerly.
GPU timings are CUDA-event medians after warm-up; CPU timings are wall-clock medians and only
meaningful as ratios within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from charstream.kernels.gemm_allreduce import gemm_all_reduce_reference
from charstream.model.config import ModelConfig, get_preset
from charstream.pipeline.bench.output import commit_id, cuda_median_ms, free_port
from charstream.stages.diffusion.tp_group import NO_MULTICAST

REFERENCE_US = {"gemm_then_nccl": 208.2}  # 4xH100, docs/ARCHITECTURE.md (Reference numbers)
CPU_PRESET_SCALE = {"dim": 768, "n_heads": 12, "head_dim": 64, "ffn_dim": 3072, "n_blocks": 2}


def _time_ms(fn: Callable[[], object], device: torch.device, reps: int, warmup: int = 3) -> float:
    """Median ms per call: CUDA events on GPUs (bench_gpu's timer), wall clock on CPU; then a barrier
    so no rank starts the next figure while another still runs this one."""
    if device.type == "cuda":
        median = cuda_median_ms(fn, reps, warmup)
    else:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        median = statistics.median(times)
    dist.barrier()
    return median


def _projection_figures(cfg: ModelConfig, world: int, device: torch.device, dtype: torch.dtype,
                        g: torch.Generator, reps: int) -> dict:
    """One block's row-parallel output projection at the production shape, with its all-reduce."""
    rows, dim = cfg.tokens_per_step, cfg.dim
    k_local = (2 * cfg.n_heads * cfg.head_dim + cfg.ffn_dim) // world
    x = torch.randn(rows, k_local, generator=g, device=device, dtype=dtype)
    w = torch.randn(dim, k_local, generator=g, device=device, dtype=dtype) / k_local**0.5
    out = torch.randn(rows, dim, generator=g, device=device, dtype=dtype)

    def gemm(a: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(a, w)

    return {
        "all_reduce_ms": _time_ms(lambda: dist.all_reduce(out), device, reps),
        "gemm_ms": _time_ms(lambda: gemm(x), device, reps),
        "gemm_then_all_reduce_ms": _time_ms(lambda: gemm_all_reduce_reference(x, gemm, None), device, reps),
    }


def _rank(rank: int, world: int, port: int, cfg: ModelConfig, use_cuda: bool, reps: int, queue) -> None:
    from charstream.model.generator import Generator
    from charstream.model.step import StepOptions

    device = torch.device(f"cuda:{rank}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if use_cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    dtype = torch.bfloat16 if use_cuda else torch.float32
    g = torch.Generator(device=device).manual_seed(rank)
    figures = _projection_figures(cfg, world, device, dtype, g, reps)
    # The serving step (on GPUs: fused FP8, CUDA-graphed, the all-reduces in the graph), then the
    # module body (GEMM, then the all-reduce hook).
    for label, fused in {"step_ms": None, "step_module_ms": False}.items():
        gen = Generator(cfg, None, device, dist.group.WORLD, dtype, fp8_cache=use_cuda, options=StepOptions(fused=fused))
        gen.reset_session(torch.zeros(cfg.latent_channels, cfg.latent_height, cfg.latent_width, device=device)
                          .normal_(generator=g))
        audio = torch.randn(cfg.n_audio_tokens, cfg.audio_dim, generator=g, device=device)
        step_reps = max(3, reps // 4)
        figures[label] = _time_ms(lambda gen=gen, audio=audio: gen.step(audio, seed=0), device, step_reps, warmup=2)
        figures[f"{label.removesuffix('_ms')}_body"] = "fused" if gen.diffusion.fused else "module"
        del gen
        if use_cuda:
            torch.cuda.empty_cache()
    if rank == 0:
        queue.put(figures)
    dist.destroy_process_group()


def run_tp_bench(preset: str, world: int, reps: int = 20) -> dict:
    cfg = get_preset(preset)
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
    if not use_cuda:
        cfg = cfg.with_(name=f"{preset}-cpu-scaled", **CPU_PRESET_SCALE)
    cfg.validate(world)
    os.environ.update(NO_MULTICAST)
    queue = mp.get_context("spawn").Queue()
    mp.start_processes(_rank, args=(world, free_port(), cfg, use_cuda, reps, queue), nprocs=world,
                       start_method="spawn")
    figures = queue.get(timeout=60)
    return {
        "preset": cfg.name, "tp": world, "rows": cfg.tokens_per_step, "dim": cfg.dim,
        "backend": "nccl" if use_cuda else "gloo",
        "device": torch.cuda.get_device_name(0) if use_cuda else "cpu",
        "torch": torch.__version__,
        "commit": commit_id(),
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if use_cuda else None,
        **figures,
    }


def print_table(result: dict) -> None:
    us = 1e3
    print(f"TP={result['tp']} {result['preset']} on {result['device']} ({result['backend']}), rows={result['rows']}")
    print(f"{'figure':32} {'measured':>12} {'reference':>12}")
    rows = [
        ("all-reduce per call (us)", result["all_reduce_ms"] * us, None),
        ("output GEMM alone (us)", result["gemm_ms"] * us, None),
        ("GEMM then all-reduce (us)", result["gemm_then_all_reduce_ms"] * us, REFERENCE_US["gemm_then_nccl"]),
        (f"step, serving ({result['step_body']}) (ms)", result["step_ms"], None),
        ("step, module body (ms)", result["step_module_ms"], None),
    ]
    for name, value, ref in rows:
        print(f"{name:32} {value:12.1f} {'' if ref is None else f'{ref:12.1f}':>12}")


def run(args: argparse.Namespace) -> int:
    """``charstream bench gpu --tp N [--preset P] [--steps REPS] [--json PATH]``."""
    result = run_tp_bench(args.preset, args.tp, args.reps)
    print_table(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
