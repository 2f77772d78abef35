"""The diffusion stage: conditioning -> latents, turn-start rollback, stale epochs, bad input."""

from __future__ import annotations

import anyio
import numpy as np
import pytest
import structlog
import torch

from charstream.model.config import TINY
from charstream.stages.base import StageContext
from charstream.stages.config import DiffusionConfig
from charstream.stages.diffusion.stage import DiffusionStage
from charstream.timeline import SAMPLES_PER_CHUNK
from charstream.transport.messages import Conditioning, Control, ControlKind, Latents


def _context(out: list) -> StageContext:
    async def emit(msg) -> None:
        out.append(msg)

    async def send_control(msg) -> None:
        pass

    return StageContext("diffusion", "s1", emit, send_control, structlog.get_logger())


def _conditioning(chunk: int, epoch: int, speech: bool) -> Conditioning:
    rng = np.random.default_rng([chunk, int(speech)])
    tokens = rng.standard_normal((TINY.n_audio_tokens, TINY.audio_dim)).astype(np.float32) * (1.0 if speech else 0.1)
    return Conditioning("s1", chunk, tokens, np.zeros(SAMPLES_PER_CHUNK, np.int16), speech, epoch)


async def _session(idle_chunks: int, rollback_to: int | None, device: str = "cpu") -> tuple[DiffusionStage, list[Latents]]:
    # CPU: the module body with a fp32 ring; CUDA: the defaults there (FP8 ring: the fused step, graphed)
    config = DiffusionConfig(device=device, seed=7, fp8_cache=False if device == "cpu" else None)
    stage, out = DiffusionStage(config, "tiny", weights=None), []
    ctx = _context(out)
    await stage.setup(ctx)
    for chunk in range(idle_chunks):
        await stage.process(_conditioning(chunk, 0, False), ctx)
    if rollback_to is not None:
        await stage.control(Control("s1", 0, ControlKind.ROLLBACK, chunk=rollback_to, epoch=1), ctx)
        await stage.process(_conditioning(idle_chunks, 0, False), ctx)  # stale epoch: dropped
    epoch = 1 if rollback_to is not None else 0
    start = (rollback_to + 1) if rollback_to is not None else idle_chunks
    for chunk in range(start, start + 2):
        await stage.process(_conditioning(chunk, epoch, True), ctx)
    return stage, out


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
def test_rollback_regenerates_the_chunks_never_played(device):
    async def main():
        rolled, out = await _session(idle_chunks=5, rollback_to=2, device=device)
        straight, expected = await _session(idle_chunks=3, rollback_to=None, device=device)
        return rolled, out, straight, expected

    rolled, out, straight, expected = anyio.run(main)
    assert rolled.diffusion_step.graphed == rolled.diffusion_step.fused == (device == "cuda")
    assert [m.chunk for m in out] == [0, 1, 2, 3, 4, 3, 4]
    assert [m.epoch for m in out] == [0, 0, 0, 0, 0, 1, 1]
    assert rolled.stats.stale == 1 and rolled.stats.rollbacks == 1 and rolled.stats.context_lost == 0
    # chunks 3 and 4 with speech equal those of a session that never idled through them
    for got, want in zip(out[-2:], expected[-2:], strict=True):
        assert got.chunk == want.chunk and got.speaking
        np.testing.assert_array_equal(got.latents, want.latents)
    # and they differ from the idle chunks they replace
    assert not np.allclose(out[3].latents, out[5].latents)
    assert out[0].latents.shape == (TINY.latent_channels, TINY.latent_height, TINY.latent_width)


def test_bad_conditioning_is_dropped_and_counted():
    async def main():
        stage, out = DiffusionStage(DiffusionConfig(seed=7, fp8_cache=False), "tiny", weights=None), []
        ctx = _context(out)
        await stage.setup(ctx)
        wrong = _conditioning(0, 0, True)
        wrong.audio_tokens = wrong.audio_tokens[:, :10]
        await stage.process(wrong, ctx)
        nan = _conditioning(0, 0, True)
        nan.audio_tokens[0, 0] = np.nan
        await stage.process(nan, ctx)
        await stage.process(_conditioning(0, 0, True), ctx)
        await stage.process(_conditioning(0, 0, True), ctx)  # the same chunk again
        return stage, out

    stage, out = anyio.run(main)
    assert stage.stats.bad == 3 and stage.stats.generated == 1
    assert [m.chunk for m in out] == [0]


def test_tp_group_from_the_session_config_matches_one_rank():
    """The stage reads TP size, and per-rank devices from the config's
    diffusion section (what pipeline/runtime/layouts.py fills) and produces TP=1's latents."""
    async def latents(config: DiffusionConfig) -> list[np.ndarray]:
        # One weights file (the shipped one): random weights are drawn per shard.
        stage, out = DiffusionStage(config, "tiny", weights="packaged"), []
        ctx = _context(out)
        await stage.setup(ctx)
        try:
            for chunk in range(3):
                await stage.process(_conditioning(chunk, 0, chunk > 0), ctx)
            return type(stage.generator).__name__, [m.latents for m in out]
        finally:
            await stage.teardown()

    kind, expected = anyio.run(latents, DiffusionConfig(seed=7, fp8_cache=False))
    assert kind == "Generator"
    two = DiffusionConfig(seed=7, fp8_cache=False, tp=2, devices=["cpu", "cpu"])
    kind, got = anyio.run(latents, two)
    assert kind == "TPGenerator"
    for a, b in zip(expected, got, strict=True):
        assert np.linalg.norm(a - b) / np.linalg.norm(a) < 1e-4


def test_each_step_is_recorded_in_the_session_step_time_metric():
    from charstream.stages.shared.metrics import REGISTRY

    async def main():
        stage, out = DiffusionStage(DiffusionConfig(seed=7, fp8_cache=False), "tiny", weights=None), []
        ctx = _context(out)
        ctx.session_id = "step-metric"
        await stage.setup(ctx)
        for chunk in range(3):
            await stage.process(_conditioning(chunk, 0, False), ctx)
        return stage

    stage = anyio.run(main)
    count = REGISTRY.get_sample_value("charstream_step_seconds_count", {"session": "step-metric"})
    total = REGISTRY.get_sample_value("charstream_step_seconds_sum", {"session": "step-metric"})
    assert count == 3 and stage.stats.generated == 3
    assert total >= stage.stats.last_step_s > 0
