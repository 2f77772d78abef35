"""Cross-session batching at the stage level (stages/diffusion/batcher.py): diffusion stages sharing one
``StepBatcher`` emit the latents they emit unbatched -- stepping concurrently, one rolling back, one
leaving and a newcomer taking its lane -- a step refused on its own fails its session only, and real
inproc sessions made by ``session_factory`` stream through one batched forward."""

from __future__ import annotations

import asyncio
import dataclasses

import anyio
import numpy as np
import pytest
from batch_support import (
    alone_then_together,
    assert_emitted_alike,
    assert_same_frames,
    play_plan,
    recording_context,
    released_frames,
    seeded_configs,
    worker_ended,
)

from charstream.model.config import TINY
from charstream.stages.config import DiffusionConfig
from charstream.stages.diffusion.batcher import StepBatcher
from charstream.stages.diffusion.stage import DiffusionStage
from charstream.timeline import CHARACTERS
from charstream.transport.messages import Conditioning


def _conditioning(name: str, chunk: int, epoch: int) -> Conditioning:
    rng = np.random.default_rng([ord(c) for c in name] + [chunk, epoch])
    tokens = rng.standard_normal((TINY.n_audio_tokens, TINY.audio_dim)).astype(np.float32)
    return Conditioning(name, chunk, tokens, np.zeros(CHARACTERS.samples_per_chunk, np.int16), epoch > 0, epoch)


# Per session: its seed, identity, and what reaches its stage: ("c", chunk, epoch) conditioning,
# ("r", last committed, epoch) a ROLLBACK. "b" rolls back to chunk 2 and regenerates 3, 4 in epoch 1;
# "c" leaves after 3 chunks and "d" joins then, on c's lane.
PLANS = {
    "a": (1, 0, [("c", n, 0) for n in range(6)]),
    "b": (2, 1, [("c", n, 0) for n in range(5)] + [("r", 2, 1)] + [("c", n, 1) for n in (3, 4, 5)]),
    "c": (3, 2, [("c", n, 0) for n in range(3)]),
    "d": (4, 3, [("c", n, 0) for n in range(3)]),
}


async def _play(name: str, batcher: StepBatcher | None, config: DiffusionConfig) -> list[tuple[int, int, np.ndarray]]:
    seed, identity, plan = PLANS[name]
    stage, out = DiffusionStage(dataclasses.replace(config, seed=seed), "tiny", identity=identity, batcher=batcher), []
    await play_plan(stage, recording_context("diffusion", name, out), plan,
                    lambda chunk, epoch: _conditioning(name, chunk, epoch))
    return [(m.chunk, m.epoch, m.latents) for m in out]


def test_stages_sharing_a_batcher_emit_their_unbatched_latents():
    config = DiffusionConfig(fp8_cache=False)
    batched = DiffusionConfig(fp8_cache=False, batch_sessions=3, batch_window_s=0.5)
    batcher = StepBatcher(batched, "tiny")

    alone, together = anyio.run(alone_then_together, _play, PLANS, batcher, config, batched)
    assert_emitted_alike(alone, together)
    assert [(c, e) for c, e, _ in alone["b"]][-3:] == [(3, 1), (4, 1), (5, 1)]
    assert not np.allclose(alone["a"][0][2], alone["b"][0][2])  # sessions differ: seeds, identities, audio
    assert batcher.stats.largest == 3 and batcher.stats.steps == sum(len(v) for v in together.values())
    assert batcher.stats.forwards < batcher.stats.steps  # steps really shared forwards
    assert batcher._open == 0 and worker_ended(batcher) and not batcher.batch.sessions  # all left, worker gone


def test_a_step_refused_on_its_own_fails_only_its_session():
    config = DiffusionConfig(fp8_cache=False, batch_sessions=2, batch_window_s=0.5)
    batcher = StepBatcher(config, "tiny")

    async def main():
        stages = [DiffusionStage(dataclasses.replace(config, seed=s), "tiny", batcher=batcher) for s in (1, 2)]
        outs: list[list] = [[], []]
        ctxs = [recording_context("diffusion", n, out) for n, out in zip("xy", outs, strict=True)]
        for stage, ctx in zip(stages, ctxs, strict=True):
            await stage.setup(ctx)
        batcher.batch.close(stages[0].generator)  # x's lane taken from under it: its next step cannot run
        errors: list[BaseException] = []

        async def step(i: int) -> None:
            try:
                await stages[i].process(_conditioning("xy"[i], 0, 0), ctxs[i])
            except RuntimeError as e:
                errors.append(e)

        async with anyio.create_task_group() as tg:
            tg.start_soon(step, 0)
            tg.start_soon(step, 1)
        stages[0].generator = None  # its lane is gone already
        for stage in stages:
            await stage.teardown()
        return outs, errors

    outs, errors = anyio.run(main)
    assert len(errors) == 1 and "before reset_session" in str(errors[0])
    assert outs[0] == [] and [m.chunk for m in outs[1]] == [0]


def test_a_full_batcher_refuses_the_next_session_clearly():
    config = DiffusionConfig(fp8_cache=False, batch_sessions=2)
    batcher = StepBatcher(config, "tiny")

    async def main():
        stages = [DiffusionStage(config, "tiny", batcher=batcher) for _ in range(3)]
        for stage in stages[:2]:
            await stage.setup(recording_context("diffusion", "s", []))
        with pytest.raises(RuntimeError, match="holds 2 sessions"):
            await stages[2].setup(recording_context("diffusion", "s", []))
        for stage in stages:
            await stage.teardown()

    anyio.run(main)
    assert batcher._open == 0
    with pytest.raises(ValueError, match="tp = 1"):
        StepBatcher(DiffusionConfig(batch_sessions=2, tp=2), "tiny")
    with pytest.raises(ValueError, match="serves tiny"):
        DiffusionStage(config, "characters-14b", batcher=batcher)


def test_real_sessions_stream_through_one_batched_forward():
    """Three inproc sessions with batching release the frames of the same sessions unbatched."""
    alone = asyncio.run(released_frames(seeded_configs(1, 1), 36))  # 9 chunks
    configs = seeded_configs(3, 1)
    batcher = StepBatcher(configs[0].diffusion, configs[0].preset)
    together = asyncio.run(released_frames(configs, 36, step_batcher=batcher))
    assert_same_frames(together, alone, at_least=24)
    assert batcher.stats.largest >= 2 and batcher._open == 0


def test_a_session_ending_while_its_step_waits_drops_it_and_the_others_go_on():
    config = DiffusionConfig(fp8_cache=False, batch_sessions=2, batch_window_s=0.5)
    batcher = StepBatcher(config, "tiny")

    async def main():
        x, y = (DiffusionStage(dataclasses.replace(config, seed=s), "tiny", batcher=batcher) for s in (1, 2))
        out_x, out_y = [], []
        ctx_x, ctx_y = recording_context("diffusion", "x", out_x), recording_context("diffusion", "y", out_y)
        await x.setup(ctx_x)
        await y.setup(ctx_y)
        lane_x = x.generator
        with anyio.move_on_after(0.1):  # x's step waits for y's (the window is 0.5 s); x's session ends
            await x.process(_conditioning("x", 0, 0), ctx_x)
        await x.teardown()
        await y.process(_conditioning("y", 0, 0), ctx_y)
        await y.teardown()
        return lane_x, out_x, out_y

    lane_x, out_x, out_y = anyio.run(main)
    assert out_x == [] and lane_x.next_frame == 0  # dropped before any forward took it
    assert [m.chunk for m in out_y] == [0] and batcher.stats.forwards == 1 and batcher.stats.largest == 1
