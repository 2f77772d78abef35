"""Multi-rank diffusion on CPU (gloo, spawned processes): the TP group driven by rank 0 produces the
same frames as TP=1 -- the module body with and without the overlapped GEMM + all-reduce, and the
fused FP8 step every GPU rank runs -- and the overlapped decomposition equals GEMM-then-all-reduce
on fresh random inputs."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from charstream.kernels.gemm_allreduce import GemmAllReduce, gemm_all_reduce_reference
from charstream.model.config import TINY
from charstream.model.dit import DiT
from charstream.model.generator import Generator
from charstream.model.vae import VideoVAE, to_uint8_frames
from charstream.model.weights import save_weights
from charstream.stages.tp_group import TPGenerator

CFG = TINY.with_(n_blocks=2, height=64, width=64, window_frames=3, reset_every=2, rollback_frames=2)
STEPS = 5


def _frames(gen, vae: VideoVAE) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    gen.reset_session(torch.randn(CFG.latent_channels, CFG.latent_height, CFG.latent_width, generator=g))
    latents = [gen.step(torch.randn(CFG.n_audio_tokens, CFG.audio_dim, generator=g), seed=i) for i in range(STEPS)]
    gen.rollback(1)
    latents.append(gen.step(torch.randn(CFG.n_audio_tokens, CFG.audio_dim, generator=g), seed=99))
    with torch.inference_mode():
        video, _ = vae.decode(torch.stack(latents)[None])  # (1, 4 * frames, 3, H, W) in [-1, 1]
    return to_uint8_frames(video), torch.stack(latents)


@pytest.fixture(scope="module")
def single_rank(tmp_path_factory):
    path = tmp_path_factory.mktemp("w") / "tp.safetensors"
    save_weights(DiT(CFG).init_random_(seed=7), path)
    vae = VideoVAE(CFG).eval()
    one = {fused: _frames(Generator(CFG, weights=path, fused=fused), vae) for fused in (False, True)}
    return path, vae, one


# (TP size, the fused FP8 step, the module body's overlapped output projection); the fused step's
# FP8 rows are quantised per rank, so it matches TP=1 within FP8 rounding (tests/test_model_tp.py).
@pytest.mark.parametrize("world,fused,overlapped,tolerance", [(2, False, False, 1e-4), (4, False, True, 1e-4),
                                                               (2, True, False, 1e-3)])
def test_tp_group_produces_the_frames_of_one_rank(single_rank, world, fused, overlapped, tolerance):
    path, vae, one = single_rank
    frames, latents = one[fused]
    group = TPGenerator(CFG, world, weights=path, fused=fused, fused_gemm_all_reduce=overlapped)
    try:
        assert group.generator.diffusion.fused == fused
        tp_frames, tp_latents = _frames(group, vae)
        if overlapped:
            assert group.generator.fused_all_reduce.nbytes == CFG.tokens_per_step * CFG.dim * 4
    finally:
        group.close()
    rel = (tp_latents - latents).norm() / latents.norm()
    assert rel < tolerance, f"TP={world} latents differ from TP=1 by {rel:.2e}"
    assert tp_frames.shape == frames.shape
    assert (tp_frames.int() - frames.int()).abs().max() <= 1  # reduction order only


def _decomposition_rank(rank: int, world: int, port: int, rows: int, queue) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    pair = dist.new_group([0, 1])  # every rank takes part in creating it
    try:
        for size, group in ((world, None), (2, pair)):
            if rank >= size:
                continue
            k_shard, n = 96, 160
            g = torch.Generator().manual_seed(1234 + size)  # the full problem, identical on every rank
            x = torch.randn(rows, k_shard * size, generator=g)
            w = torch.randn(n, k_shard * size, generator=g)
            cols = slice(rank * k_shard, (rank + 1) * k_shard)
            shard = w[:, cols].T  # this rank's row-parallel shard
            linear = shard.__rmatmul__
            fused = GemmAllReduce(rows, n, torch.float32, "cpu", group, tiles=4)
            got = fused(x[:, cols], linear).clone()
            plain = gemm_all_reduce_reference(x[:, cols], linear, group)
            other_shape = fused(x[: rows - 1, cols], linear)  # not the steady shape: falls back
            exact = x.double() @ w.double().T
            queue.put((size, rank, float((got.double() - exact).norm() / exact.norm()),
                       float((got - plain).abs().max()),
                       float((other_shape.double() - exact[: rows - 1]).norm() / exact.norm())))
    finally:
        dist.destroy_process_group()


def test_overlapped_gemm_all_reduce_equals_gemm_then_all_reduce():
    """At the production row count (757), over 4 ranks and over a 2-rank subgroup."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").Queue()
    mp.start_processes(_decomposition_rank, args=(4, port, 757, queue), nprocs=4, start_method="spawn")
    results = [queue.get(timeout=10) for _ in range(4 + 2)]
    assert sorted((size, rank) for size, rank, *_ in results) == [(2, 0), (2, 1), (4, 0), (4, 1), (4, 2), (4, 3)]
    for size, rank, rel_exact, max_vs_plain, rel_fallback in results:
        assert rel_exact < 1e-5, f"TP={size} rank {rank}: fused vs exact {rel_exact:.2e}"
        assert max_vs_plain < 1e-3, f"TP={size} rank {rank}: fused vs GEMM+all-reduce {max_vs_plain:.2e}"
        assert rel_fallback < 1e-5


def test_fused_path_refuses_an_unsharded_model():
    from charstream.model.tp import fuse_output_all_reduce

    with pytest.raises(ValueError, match="sharded"):
        fuse_output_all_reduce(DiT(CFG), CFG.tokens_per_step)


def test_overlapped_all_reduce_is_refused_with_the_fused_step():
    with pytest.raises(ValueError, match="fused FP8 step"):
        TPGenerator(CFG, 2, fused=True, fused_gemm_all_reduce=True)
