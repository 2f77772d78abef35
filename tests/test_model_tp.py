"""Tensor parallelism: TP = 2, 3 and 4 over gloo in spawned processes equal TP = 1, each rank reading
only its shard from one safetensors file, with exactly one all-reduce per block per pass."""

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
from charstream.model.weights import save_weights

CFG = TINY.with_(n_blocks=2, height=64, width=64, window_frames=2, reset_every=1, rollback_frames=1)
STEPS, ROLLBACK = 4, 1  # positions reset before frame 3; the rollback undoes that reset


def _session(gen: Generator) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    gen.reset_session(torch.randn(CFG.latent_channels, CFG.latent_height, CFG.latent_width, generator=g))
    audio = [torch.randn(CFG.n_audio_tokens, CFG.audio_dim, generator=g) for _ in range(STEPS + ROLLBACK)]
    out = [gen.step(a, seed=i) for i, a in enumerate(audio[:STEPS])]
    gen.rollback(ROLLBACK)
    out += [gen.step(a, seed=50 + i) for i, a in enumerate(audio[STEPS:])]
    shape = out[0].shape
    seeds = [*range(STEPS), *(50 + i for i in range(ROLLBACK))]
    return [o - seeded_noise(shape, s) for o, s in zip(out, seeds, strict=True)]


def _rank(rank: int, world: int, port: int, weights: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    calls = []
    all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, *args, **kwargs):
        calls.append(tensor.shape)
        return all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counting_all_reduce
    try:
        gen = Generator(CFG, weights=weights, tp_group=dist.group.WORLD, fp8_cache=True)
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
def reference(tmp_path_factory) -> tuple[str, list[torch.Tensor], int]:
    torch.manual_seed(0)
    model = DiT(CFG).init_random_(seed=5)
    path = tmp_path_factory.mktemp("weights") / "tiny-test.safetensors"
    save_weights(model, path)
    gen = Generator(CFG, weights=path, fp8_cache=True)
    return str(path), _session(gen), sum(p.numel() for p in gen.model.parameters())


@pytest.mark.parametrize("world", [2, 3, 4])
def test_tensor_parallel_equals_single_rank(reference, world, tmp_path):
    weights, expected, full_params = reference
    # forkserver: each rank is a fresh process forked from a server that imported torch once
    mp.set_forkserver_preload(["torch", "charstream.model.generator"])
    mp.start_processes(_rank, args=(world, _free_port(), weights, str(tmp_path)), nprocs=world, start_method="forkserver")
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for res in results:
        assert res["heads"] == CFG.n_heads // world  # each rank caches only its heads
        # one all-reduce per block per forward: the sink pass + 4 passes per step
        assert res["all_reduces"] == CFG.n_blocks * (1 + 4 * (STEPS + ROLLBACK))
        for got, want in zip(res["out"], expected, strict=True):
            # fp32 model, FP8 cache: only the all-reduce's summation order differs
            assert ((got - want).norm() / want.norm()).item() < 1e-4
    # the shards are smaller than the whole model (the replicated embeddings/adaLN are the rest)
    assert results[0]["params"] < full_params
