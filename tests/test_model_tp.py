"""Tensor parallelism through the one diffusion step (model/step/): TP = 2 and 4 over real gloo
process groups give TP = 1's latents, for the module body and the fused FP8 body (the one the GPU
graphs), each rank reading only its shard of one safetensors file, with exactly one all-reduce per
block per pass, through a rollback and a position reset."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from charstream.model.config import TINY
from charstream.model.dit import DiT
from charstream.model.generator import Generator
from charstream.model.sampler import seeded_noise
from charstream.model.step import StepOptions
from charstream.model.weights import save_weights

CFG = TINY.with_(n_blocks=2, height=64, width=64, window_frames=2, reset_every=1, rollback_frames=1)
STEPS, ROLLBACK = 4, 1  # positions reset before frame 3; the rollback undoes that reset
# Module body: fp32 GEMMs, only the all-reduce's summation order differs. Fused body: each rank
# quantizes its own slice of the output projection's input rows to FP8 (per-row scales over fewer
# columns), so TP differs from TP = 1 by FP8 rounding: ~3e-4 here, where other inputs move it 4e-3.
TOLERANCE = {False: 1e-4, True: 1e-3}


def _session(gen: Generator, seed: int = 11) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    gen.reset_session(torch.randn(CFG.latent_channels, CFG.latent_height, CFG.latent_width, generator=g))
    audio = [torch.randn(CFG.n_audio_tokens, CFG.audio_dim, generator=g) for _ in range(STEPS + ROLLBACK)]
    out = [gen.step(a, seed=i) for i, a in enumerate(audio[:STEPS])]
    assert gen.cache.offset > 0  # a position reset happened
    assert gen.rollback(ROLLBACK) == 0
    out += [gen.step(a, seed=50 + i) for i, a in enumerate(audio[STEPS:])]
    shape = out[0].shape
    seeds = [*range(STEPS), *(50 + i for i in range(ROLLBACK))]
    return [o - seeded_noise(shape, s) for o, s in zip(out, seeds, strict=True)]


def _rank(rank: int, world: int, port: int, weights: str, fused: bool, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    calls = []
    all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, *args, **kwargs):
        calls.append(tensor.shape)
        return all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counting_all_reduce
    try:
        gen = Generator(CFG, weights=weights, tp_group=dist.group.WORLD, fp8_cache=True, options=StepOptions(fused=fused))
        params = sum(p.numel() for p in gen.model.parameters())
        out = _session(gen)
        torch.save({"out": out, "all_reduces": len(calls), "params": params, "heads": gen.cache.k.shape[1]},
                   Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.all_reduce = all_reduce
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("weights") / "tiny-test.safetensors"
    save_weights(DiT(CFG).init_random_(seed=5), path)
    return str(path)


@pytest.fixture(scope="module")
def single_rank(weights) -> dict:
    """TP = 1 of each body, and how far a session with other inputs lands (the fused body's scale)."""
    out = {}
    for fused in (False, True):
        gen = Generator(CFG, weights=weights, fp8_cache=True, options=StepOptions(fused=fused))
        out[fused] = (_session(gen), sum(p.numel() for p in gen.model.parameters()))
    out["other"] = _session(Generator(CFG, weights=weights, fp8_cache=True, options=StepOptions(fused=True)), seed=12)
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_fused_body_computes_what_the_module_body_computes(single_rank):
    module, fused = single_rank[False][0], single_rank[True][0]
    errors = [_rel(f, m) for f, m in zip(fused, module, strict=True)]
    other = [_rel(o, m) for o, m in zip(single_rank["other"], module, strict=True)]
    assert max(errors) < 0.05, errors  # FP8 weights and activations against fp32 GEMMs
    assert min(other) > 5 * max(errors)  # and far below what other inputs change


@pytest.mark.parametrize("fused", [False, True], ids=["module", "fused"])
@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_equals_single_rank(weights, single_rank, world, fused, tmp_path):
    expected, full_params = single_rank[fused]
    # forkserver: each rank is a fresh process forked from a server that imported torch once
    mp.set_forkserver_preload(["torch", "charstream.model.generator"])
    mp.start_processes(_rank, args=(world, _free_port(), weights, fused, str(tmp_path)), nprocs=world,
                       start_method="forkserver")
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for res in results:
        assert res["heads"] == CFG.n_heads // world  # each rank caches only its heads
        # one all-reduce per block per forward: the sink pass + 4 passes per step
        assert res["all_reduces"] == CFG.n_blocks * (1 + 4 * (STEPS + ROLLBACK))
        for got, want in zip(res["out"], expected, strict=True):
            assert _rel(got, want) < TOLERANCE[fused]
    # every rank computed the same latents (rank 0's are what a session uses)
    for res in results[1:]:
        for a, b in zip(res["out"], results[0]["out"], strict=True):
            assert torch.equal(a, b)
    # the shards are smaller than the whole model (the replicated embeddings/adaLN are the rest)
    assert results[0]["params"] < full_params
