"""Decode stage: latents -> frames with the temporal cache carried, rollback restores it, bad input."""

from __future__ import annotations

import anyio
import numpy as np
import pytest
import structlog
import torch
from decode_support import audio_for, latents_for, latents_message
from structlog.testing import LogCapture

from charstream.model.vae import to_uint8_frames
from charstream.model.weights import load_decoder
from charstream.pipeline.config import PipelineConfig
from charstream.pipeline.runtime.runner import Edge, Graph, Node, run_session
from charstream.stages.base import StageContext
from charstream.stages.config import DecodeConfig
from charstream.stages.decode.stage import DecodeStage
from charstream.transport.messages import Conditioning, Control, ControlKind, Latents, Message, VideoChunk

SEED = 7


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def reference_frames(sequence: list[tuple[int, int]]) -> np.ndarray:
    """Whole-clip decode of the (chunk, epoch) latents in order, with the stage's seeded weights."""
    decoder = load_decoder("tiny", None, "cpu", torch.float32, seed=SEED)
    latents = torch.stack([torch.from_numpy(latents_for(c, e)) for c, e in sequence])[None]
    with torch.inference_mode():
        video, _ = decoder(latents)
    return to_uint8_frames(video[0]).numpy()  # (4 * len, H, W, 3)


def assert_frames(got: np.ndarray, want: np.ndarray) -> None:
    # float rounding may flip a value sitting exactly on a .5 boundary
    assert np.abs(got.astype(int) - want.astype(int)).max() <= 1


def context(out: list[Message], logs: LogCapture) -> StageContext:
    async def emit(msg: Message) -> None:
        out.append(msg)

    async def send_control(msg: Control) -> None:
        raise AssertionError("the decode stage sends no control")

    log = structlog.wrap_logger(structlog.PrintLogger(), processors=[logs],
                                wrapper_class=structlog.make_filtering_bound_logger(0))
    return StageContext("decode", "s1", emit, send_control, log)


def test_decode_stage_in_process_rollback_and_bad_input() -> None:
    out: list[Message] = []
    logs = LogCapture()

    async def scenario() -> DecodeStage:
        stage = DecodeStage(DecodeConfig(), "tiny", weights=None, seed=SEED)
        ctx = context(out, logs)
        await stage.setup(ctx)
        for chunk in range(5):  # idle chunks 0..4; chunk 3 carries a turn
            await stage.process(latents_message("s1", chunk, 0, turn_id=1 if chunk == 3 else None), ctx)
        # playout committed chunk 2: chunks 3, 4 are regenerated in epoch 1
        await stage.control(Control("s1", 1, ControlKind.ROLLBACK, chunk=2, epoch=1), ctx)
        await stage.process(latents_message("s1", 5, 0), ctx)  # stale: dropped
        for chunk in (3, 4):
            await stage.process(latents_message("s1", chunk, 1), ctx)
        # epoch 2 data overtakes its ROLLBACK (committed 4): implicit rollback; the late control changes nothing
        await stage.process(latents_message("s1", 5, 2), ctx)
        await stage.control(Control("s1", 2, ControlKind.ROLLBACK, chunk=4, epoch=2), ctx)
        await stage.process(latents_message("s1", 6, 2), ctx)
        # nothing committed yet (-1): the session restarts with no history
        await stage.control(Control("s1", 3, ControlKind.ROLLBACK, chunk=-1, epoch=3), ctx)
        await stage.process(latents_message("s1", 0, 3), ctx)
        # bad input is counted and dropped, the stage goes on
        bad = latents_message("s1", 1, 3)
        bad.latents = bad.latents[:4]
        await stage.process(bad, ctx)
        await stage.process(Conditioning("s1", 1, np.zeros((4, 8), np.float32), audio_for(1), False, 3), ctx)
        await stage.teardown()
        return stage

    stage = anyio.run(scenario)
    chunks = [m for m in out if isinstance(m, VideoChunk)]
    assert [(m.chunk, m.epoch) for m in chunks] == [(0, 0), (1, 0), (2, 0), (3, 0), (4, 0), (3, 1), (4, 1),
                                                    (5, 2), (6, 2), (0, 3)]
    assert stage.stats.stale == 1 and stage.stats.bad == 2 and stage.stats.gaps == 0
    assert sum(1 for e in logs.entries if e["event"] == "decode_bad_input") == 2

    first = reference_frames([(c, 0) for c in range(5)])
    rolled = reference_frames([(0, 0), (1, 0), (2, 0), (3, 1), (4, 1), (5, 2), (6, 2)])
    for m in chunks[:5]:
        assert_frames(m.frames, first[4 * m.chunk : 4 * m.chunk + 4])
    for m in chunks[5:9]:  # continuous with the committed chunk 2, whatever was decoded after it
        assert_frames(m.frames, rolled[4 * m.chunk : 4 * m.chunk + 4])
    assert_frames(chunks[9].frames, reference_frames([(0, 3)]))
    # not vacuous: continuing from the stale chunk 4's state would have given other frames
    stale_continuation = reference_frames([(c, 0) for c in range(5)] + [(3, 1)])[20:24]
    assert np.abs(stale_continuation.astype(int) - chunks[5].frames.astype(int)).max() > 4

    for m in chunks:
        assert m.frames.dtype == np.uint8 and m.frames.shape == (4, 128, 128, 3)
        np.testing.assert_array_equal(m.audio, audio_for(m.chunk))
        assert ("decode_done" in m.trace.stamps) == (m.trace.turn_id is not None)
    assert chunks[3].trace.turn_id == 1 and chunks[3].speaking


def test_decode_stage_in_its_own_process_rolls_back() -> None:
    first, rollback_to = 4, 1
    graph = Graph(
        [
            Node("src", "decode_support:LatentsSource", {"first": first}),
            Node("decode", DecodeStage, {"config": DecodeConfig(threads=1), "preset": "tiny", "weights": None, "seed": SEED},
                 "decoder"),
            Node("sink", "decode_support:FrameSink", {"first": first, "rollback_to": rollback_to}),
        ],
        [Edge("src", "decode", capacity=2), Edge("decode", "sink", capacity=2)],
    )
    result = anyio.run(run_session, graph, PipelineConfig(hosting="processes"), "s-decode")
    assert result.ok, result.error
    assert "decoder" in result.processes
    chunks = result.stages["sink"].chunks
    assert [(m.chunk, m.epoch) for m in chunks] == [(0, 0), (1, 0), (2, 0), (3, 0), (2, 1), (3, 1)]
    first_pass = reference_frames([(c, 0) for c in range(4)])
    regenerated = reference_frames([(0, 0), (1, 0), (2, 1), (3, 1)])
    for m in chunks:
        want = first_pass if m.epoch == 0 else regenerated
        assert_frames(m.frames, want[4 * m.chunk : 4 * m.chunk + 4])
    assert "decode_done" in chunks[1].trace.stamps and "decode_done" not in chunks[0].trace.stamps


def test_latents_message_shape_matches_preset() -> None:
    msg = latents_message("s1", 0, 0)
    assert isinstance(msg, Latents) and msg.latents.shape == (8, 16, 16)
