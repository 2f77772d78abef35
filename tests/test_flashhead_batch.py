"""FlashHead sessions batched (CPU, fp32, the 2-block DiT at the real width, a quarter-width VAE, 32 x 32):
several sessions' chunks denoised and decoded in one batch are the chunks each session makes alone -- its
motion latents, portrait, colour reference and noise stay its own -- and the stages' batchers run them
together."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from test_flashhead_chunks import SMALL, parts, portrait  # noqa: F401 -- the module's fixture

from charstream.model.families.flashhead.chunks import (
    ChunkMotionStream,
    ChunkRunner,
    batch_groups,
    portrait_tensor,
)
from charstream.model.families.flashhead.config import LITE
from charstream.model.families.flashhead.loader import load_dit
from charstream.model.families.flashhead.vae_ltx import random_ltx_vae


def faces(n: int) -> list[torch.Tensor]:
    """``n`` different portraits (the example face, its colours turned)."""
    return [portrait_tensor(np.roll(portrait(), i, axis=2), 32, 32) for i in range(n)]


def run_alone(dit, vae, portraits, seeds, tokens, chunks):
    """Each session's chunks by its own stream: [(latents, frames)] per session per chunk."""
    out = []
    for face, seed, session_tokens, session_chunks in zip(portraits, seeds, tokens, chunks, strict=True):
        stream = ChunkMotionStream(dit, vae, face, seed)
        made = []
        for t, chunk in zip(session_tokens, session_chunks, strict=True):
            latents = stream.denoise(t, chunk)
            made.append((latents, stream.decode(latents)))
        out.append(made)
    return out


def run_batched(dit, vae, portraits, seeds, tokens, chunks):
    """The same sessions, every step of theirs in one batch through one shared runner."""
    runner = ChunkRunner(dit, vae, batched=True)
    streams = [ChunkMotionStream(dit, vae, face, seed) for face, seed in zip(portraits, seeds, strict=True)]
    out = [[] for _ in streams]
    for step in range(len(tokens[0])):
        for stream, session_chunks in zip(streams, chunks, strict=True):
            stream.ready(session_chunks[step])
        latents = runner.denoise(streams, [t[step] for t in tokens])
        frames, motions = runner.decode(streams, latents)
        for i, stream in enumerate(streams):
            stream.decoded(motions[i], frames[i])
            out[i].append((latents[i], frames[i]))
    return out


def assert_same(alone, batched):
    for session_alone, session_batched in zip(alone, batched, strict=True):
        for (latents, frames), (b_latents, b_frames) in zip(session_alone, session_batched, strict=True):
            torch.testing.assert_close(b_latents, latents, rtol=1e-4, atol=1e-4)
            assert np.abs(b_frames.astype(int) - frames.astype(int)).max() <= 1


def test_pro_chunks_in_one_batch_are_each_sessions_own(parts):  # noqa: F811
    dit, vae = parts
    rng = np.random.default_rng(7)
    tokens = [[rng.normal(size=(9, SMALL.audio_tokens, SMALL.dim)).astype(np.float32) for _ in range(2)]
              for _ in range(2)]
    # the second session rolls back to its start at its second step: a first chunk (one motion latent)
    # batched beside a later one (two)
    chunks = [[0, 1], [0, 0]]
    portraits, seeds = faces(2), [4, 5]
    alone = run_alone(dit, vae, portraits, seeds, tokens, chunks)
    batched = run_batched(dit, vae, portraits, seeds, tokens, chunks)
    assert_same(alone, batched)
    # the sessions' chunks differ: a batch does not mix them
    assert (alone[0][1][0] - alone[1][1][0]).abs().max() > 1e-2


LITE_SMALL = LITE.with_(n_blocks=1, height=32, width=32, vae_width=0.25)


@pytest.fixture(scope="module")
def lite_parts():
    return load_dit("random", "lite", seed=2, cfg=LITE_SMALL), random_ltx_vae(3, width=LITE_SMALL.vae_width)


def test_lite_chunks_in_one_batch_draw_each_sessions_posterior_noise(lite_parts):
    cfg = LITE_SMALL
    dit, vae = lite_parts
    rng = np.random.default_rng(8)
    tokens = [[rng.normal(size=(5, cfg.audio_tokens, cfg.dim)).astype(np.float32) for _ in range(2)]
              for _ in range(2)]
    chunks = [[0, 1], [0, 1]]
    portraits, seeds = faces(2), [4, 9]
    assert_same(run_alone(dit, vae, portraits, seeds, tokens, chunks),
                run_batched(dit, vae, portraits, seeds, tokens, chunks))


def test_stage_batchers_run_two_sessions_chunks_together(lite_parts):
    """Two sessions' chunk stages on the process's batchers: their chunks go through one batch (the
    batchers' largest forward holds both) and each session gets the frames its stream makes alone (Lite:
    the batchers are the same for both variants, and its VAE is the quicker on a CPU)."""
    from ingest_support import Recorder

    from charstream.stages.config import DecodeConfig, DiffusionConfig
    from charstream.stages.decode.chunks import ChunkDecodeStage
    from charstream.stages.diffusion.chunks import ChunkDiffusionStage
    from charstream.stages.shared.chunk_batcher import ChunkDecodeBatcher, ChunkDenoiseBatcher
    from charstream.transport.messages import Conditioning, Latents, VideoChunk

    dit, vae = lite_parts
    cfg = LITE_SMALL
    shape = (cfg.latents_per_chunk, cfg.audio_tokens, cfg.dim)
    rng = np.random.default_rng(9)
    tokens = [[rng.normal(size=shape).astype(np.float32) for _ in range(2)] for _ in range(2)]
    audio = np.zeros(cfg.new_frames_per_chunk * 1_920, np.int16)
    # a forward waits up to 1 s for both sessions' items
    denoiser = ChunkDenoiseBatcher(DiffusionConfig(threads=1, batch_sessions=2, batch_window_s=1),
                                   ChunkRunner(dit, vae, batched=True))
    decoder = ChunkDecodeBatcher(DecodeConfig(threads=1, batch_sessions=2, batch_window_s=1),
                                 ChunkRunner(dit, vae, batched=True))
    portraits, seeds = faces(2), [4, 5]
    streams = [ChunkMotionStream(dit, vae, face, seed) for face, seed in zip(portraits, seeds, strict=True)]
    stages = [(ChunkDiffusionStage(DiffusionConfig(threads=1), s, shape, denoiser),
               ChunkDecodeStage(DecodeConfig(threads=1), s, decoder), Recorder()) for s in streams]

    async def session(i: int) -> list[np.ndarray]:
        diffusion, decode, rec = stages[i]
        ctx = rec.context()
        await diffusion.setup(ctx)
        await decode.setup(ctx)
        for chunk in range(2):
            await diffusion.process(Conditioning(f"s{i}", chunk, tokens[i][chunk], audio, False, 0), ctx)
            await decode.process([m for _, m in rec.data if isinstance(m, Latents)][-1], ctx)
        await diffusion.teardown()
        await decode.teardown()
        return [m.frames for _, m in rec.data if isinstance(m, VideoChunk)]

    async def main() -> list[list[np.ndarray]]:
        return await asyncio.wait_for(asyncio.gather(session(0), session(1)), 120)

    frames = asyncio.run(main())
    assert denoiser.stats.largest == 2 and denoiser.stats.forwards == 2
    assert decoder.stats.largest == 2 and decoder.stats.forwards == 2
    alone = run_alone(dit, vae, portraits, seeds, tokens, [[0, 1], [0, 1]])
    for session_frames, session_alone in zip(frames, alone, strict=True):
        assert len(session_frames) == 2
        for got, (_, expected) in zip(session_frames, session_alone, strict=True):
            assert np.abs(got.astype(int) - expected.astype(int)).max() <= 1


def test_a_runner_warms_every_batch_size_it_will_run(lite_parts):
    dit, vae = lite_parts
    runner = ChunkRunner(dit, vae, batched=True)
    sizes = []
    hook = dit.register_forward_pre_hook(lambda _, args: sizes.append(args[0].shape[0]))
    decode = runner._decode
    runner._decode = lambda latents: sizes.append(-latents.shape[0]) or decode(latents)
    try:
        runner.warm("denoise", 3)
        runner.warm("decode", 3)
    finally:
        hook.remove()
    # 3 sessions run in groups of 2 and 1: each size once per motion length, a first chunk's and a later
    # one's (4 passes each), then each decode
    assert sizes == [1] * 8 + [2] * 8 + [-1, -2]


@pytest.mark.parametrize(("rows", "sizes"), [(1, [1]), (3, [2, 1]), (8, [8]), (13, [8, 4, 1]), (16, [16])])
def test_a_batch_runs_in_power_of_two_groups_in_order(rows, sizes):
    groups = batch_groups(list(range(rows)))
    assert [len(g) for g in groups] == sizes
    assert [i for g in groups for i in g] == list(range(rows))


@pytest.mark.parametrize("generators", [2, 4])
def test_noise_rows_follow_their_own_generators(generators):
    from charstream.model.families.flashhead.noise import randn_rows

    gens = [torch.Generator().manual_seed(s) for s in range(generators)]
    batch = randn_rows((generators, 3, 5), gens, torch.float32, "cpu")
    for s in range(generators):
        assert torch.equal(batch[s:s + 1], torch.randn((1, 3, 5), generator=torch.Generator().manual_seed(s)))
    with pytest.raises(ValueError, match="3 generators for a batch of 2"):
        randn_rows((2, 3), gens[:1] * 3, torch.float32, "cpu")


def test_a_serving_process_with_batch_sessions_batches_its_flashhead_chunks():
    """``serve --batch-sessions N`` on a FlashHead model: the session factory hands its sessions the chunk
    batchers (over runners compiled for every batch size), not the characters' step batchers, and an
    encode batcher over the family's conditioner."""
    from charstream.model.families.flashhead.family import FlashHeadFamily
    from charstream.pipeline.config import PipelineConfig
    from charstream.pipeline.session import session_factory
    from charstream.stages.conditioning.batcher import EncodeBatcher
    from charstream.stages.shared.chunk_batcher import ChunkDecodeBatcher, ChunkDenoiseBatcher

    config = PipelineConfig(preset="flashhead-pro")
    config.diffusion.batch_sessions = config.decode.batch_sessions = config.conditioning.batch_sessions = 4
    factory = session_factory(config, weights="random", portrait=portrait(), family=FlashHeadFamily("pro", config=SMALL))
    assert isinstance(factory.batcher, ChunkDenoiseBatcher) and isinstance(factory.decode_batcher, ChunkDecodeBatcher)
    assert isinstance(factory.encode_batcher, EncodeBatcher) and factory.encode_batcher.max_sessions == 4
    assert factory.encode_batcher.window_samples == SMALL.audio_context_s * 48_000  # the 8 s context
    assert factory.batcher.max_sessions == 4 and factory.batcher.runner.batched
    assert factory.batcher.runner is not factory.decode_batcher.runner  # each on a stream of its own


def test_sessions_windows_encoded_in_one_batch_are_each_windows_own_tokens():
    """The conditioner's ``encode_batch`` over two sessions' 8 s windows, one quiet and one loud, gives each
    the tokens its window's own ``encode`` gives: wav2vec2's normalisation, features and windows stay per row."""
    from charstream.model.families.flashhead.family import FlashHeadFamily

    conditioner = FlashHeadFamily("pro", config=SMALL).audio_conditioner(None, "cpu", 0)
    rng = np.random.default_rng(3)
    n = SMALL.audio_context_s * 48_000
    windows = [(rng.standard_normal(n) * scale).astype(np.int16) for scale in (300, 9000)]
    batched = conditioner.encode_batch(windows)
    for window, tokens in zip(windows, batched, strict=True):
        expected = conditioner.encode(window)
        assert tokens.shape == expected.shape == (SMALL.latents_per_chunk, SMALL.audio_tokens, SMALL.dim)
        np.testing.assert_allclose(tokens, expected, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="samples at 48000 Hz"):
        conditioner.encode_batch([windows[0], windows[1][:-1]])
