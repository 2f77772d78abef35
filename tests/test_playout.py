"""Playout: the 24 fps clock, exact A/V spans, stall absorption, underruns, rollback, trace stamp."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from charstream.stages.config import PlayoutConfig
from charstream.stages.egress.testcard import card_chunk
from charstream.stages.playout import PlayoutOutput, PlayoutStage
from charstream.transport.messages import Control, ControlKind, VideoChunk
from playout_support import start_playout

from charstream.timeline import CHUNK_SECONDS, SAMPLES_PER_FRAME

SIZE = 32


def realtime_source(chunks: int, stall_after: int | None = None, stall_s: float = 0.0, speaking_from: int | None = None):
    """Chunks at the media rate on absolute deadlines; optionally one pause after chunk ``stall_after``."""

    async def source(session) -> None:
        playout, ctx = session.playout, session.ctx
        start = time.monotonic()
        for n in range(chunks):
            speaking = speaking_from is not None and n >= speaking_from
            await playout.process(card_chunk(ctx.session_id, n, SIZE, SIZE, speaking=speaking,
                                                 turn_id=1 if speaking else None), ctx)
            if n == stall_after:
                start += stall_s
            delay = start + (n + 1) * CHUNK_SECONDS - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)

    return source


async def collect(output, count: int) -> list:
    frames, index = [], 0
    await output.wait_started()
    while len(frames) < count:
        frame = await output.frame_at(index)
        frames.append(frame)
        index = frame.index + 1
    return frames


def test_frames_leave_on_the_clock_with_exactly_their_audio():
    async def main():
        session = await start_playout("clock", PlayoutStage(PlayoutConfig(target_depth_chunks=2)),
                                      realtime_source(40))
        frames = await collect(session.playout.output, 96)  # 4 s
        t0 = session.playout.output.t0
        stats = session.playout.stats
        await session.close()
        return frames, t0, stats

    frames, t0, stats = asyncio.run(main())
    assert [f.index for f in frames] == list(range(96))
    for f in frames:  # each frame is its chunk's frame, with exactly its 2,000 samples
        expected = card_chunk("clock", f.chunk, SIZE, SIZE)
        assert np.array_equal(f.image, expected.frames[f.frame_in_chunk])
        span = expected.audio[f.frame_in_chunk * SAMPLES_PER_FRAME:(f.frame_in_chunk + 1) * SAMPLES_PER_FRAME]
        assert np.array_equal(f.audio, span)
    assert [f.chunk for f in frames[::4]] == list(range(24))
    assert stats.underruns == 0 and stats.fresh_frames >= 96
    # Absolute deadlines: the last frame is no later than the first was (no accumulated sleep error).
    lateness = [f.released_at - frames[0].released_at - f.index / 24 for f in frames]
    assert np.median(lateness[-24:]) < np.median(lateness[:24]) + 0.03  # relative sleeps would drift ~0.1 s
    assert 23.0 < stats.achieved_fps <= 24.5


@pytest.mark.parametrize("depth,expect_underrun", [(2, False), (1, True)])
def test_stall_of_263ms_is_absorbed_by_a_two_chunk_buffer(depth, expect_underrun):
    async def main():
        session = await start_playout(f"stall{depth}", PlayoutStage(PlayoutConfig(target_depth_chunks=depth)),
                                      realtime_source(24, stall_after=8, stall_s=0.263))
        await collect(session.playout.output, 20 * 4)
        stats = session.playout.stats
        await session.close()
        return stats

    stats = asyncio.run(main())
    if expect_underrun:  # the same stall with half the buffer: shows the check can fail
        assert stats.underruns >= 1 and stats.underrun_frames >= 1
    else:
        assert stats.underruns == 0 and stats.underrun_frames == 0 and stats.late_chunks == 0


def test_underrun_holds_the_last_frame_with_silence_and_counts():
    async def main():
        session = await start_playout("underrun", PlayoutStage(PlayoutConfig(target_depth_chunks=1)),
                                      realtime_source(4))
        frames = await collect(session.playout.output, 16 + 12)  # 4 chunks, then 12 held frames
        # the source comes back: the first chunk after the gap was late
        for n in range(4, 7):
            await session.playout.process(card_chunk("underrun", n, SIZE, SIZE), session.ctx)
        more = await collect_from(session.playout.output, frames[-1].index + 1, 40)
        stats = session.playout.stats
        await session.close()
        return frames, more, stats

    frames, more, stats = asyncio.run(main())
    held = [f for f in frames if f.chunk is None]
    assert len(held) >= 10
    last_fresh = [f for f in frames if f.chunk is not None][-1]
    for f in held:
        assert np.array_equal(f.image, last_fresh.image) and not f.audio.any()
    # the gap, then again once the three returning chunks (re-buffered to depth 2) have played
    assert stats.underruns == 2
    assert stats.late_chunks >= 1
    assert [f.chunk for f in more if f.chunk is not None] == [4] * 4 + [5] * 4 + [6] * 4
    assert stats.achieved_fps < 23.5  # held frames are not fresh


async def collect_from(output, index: int, count: int) -> list:
    frames = []
    while len(frames) < count:
        frame = await output.frame_at(index)
        frames.append(frame)
        index = frame.index + 1
    return frames


def test_turn_start_rollback_drops_exactly_the_unplayed_chunks():
    async def fast_source(session):  # as fast as credit allows: the buffer fills to its max
        playout, ctx = session.playout, session.ctx
        for n in range(100):
            await playout.process(card_chunk(ctx.session_id, n, SIZE, SIZE), ctx)

    async def main():
        config = PlayoutConfig(target_depth_chunks=2, max_depth_chunks=6)
        session = await start_playout("rollback", PlayoutStage(config), fast_source)
        playout = session.playout
        frames = await collect(playout.output, 9)  # chunks 0, 1 and the first frame of chunk 2
        buffered = [c.chunk for c in playout._buffer]
        playing = playout.last_committed
        await playout.control(Control("rollback", 1, ControlKind.TURN_START, chunk=playing + 1), session.ctx)
        stats_after = (playout.stats.rolled_back_chunks, playout.epoch, len(playout._buffer))
        # the in-flight old-epoch chunks are discarded; the new epoch resumes after the committed one
        for n in range(playing + 1, playing + 4):
            await playout.process(card_chunk("rollback", n, SIZE, SIZE, speaking=True, epoch=1, turn_id=7),
                                  session.ctx)
        after = await collect_from(playout.output, frames[-1].index + 1, 16)
        result = dict(buffered=buffered, playing=playing, controls=list(session.controls), stats_after=stats_after,
                      stale=playout.stats.stale_chunks, after=after, stats=playout.stats)
        await session.close()
        return result

    r = asyncio.run(main())
    assert r["playing"] == 2 and r["buffered"] == [3, 4, 5, 6, 7, 8]  # max depth 6 behind the playing chunk
    [rollback] = r["controls"]
    assert rollback.kind == ControlKind.ROLLBACK and rollback.chunk == 2 and rollback.epoch == 1
    assert rollback.detail["dropped"] == len(r["buffered"])
    assert r["stats_after"] == (len(r["buffered"]), 1, 0)
    assert r["stale"] >= 1  # chunk 9 of epoch 0 was waiting for room when the rollback came
    played = [f.chunk for f in r["after"] if f.chunk is not None]
    assert set(played) <= {2, 3, 4, 5} and not set(played) & set(range(6, 9))
    assert played[:3] == [2, 2, 2] and 3 in played  # chunk 2 finishes, then the new epoch's chunk 3
    new = [f for f in r["after"] if f.epoch == 1 and f.chunk is not None]
    assert new[0].first_speaking and sum(f.first_speaking for f in r["after"]) == 1
    assert "playout_first_speaking_frame" in new[0].trace.stamps


def test_bad_chunks_are_dropped_and_counted_not_fatal():
    async def main():
        session = await start_playout("bad", PlayoutStage(PlayoutConfig(target_depth_chunks=0)), realtime_source(0))
        playout = session.playout
        good = card_chunk("bad", 0, SIZE, SIZE)
        await playout.process(VideoChunk("bad", 0, good.frames[:2], good.audio, False), session.ctx)
        await playout.process(VideoChunk("bad", 0, good.frames, good.audio[:100], False), session.ctx)
        await playout.process(VideoChunk("bad", 0, good.frames.astype(np.float32), good.audio, False), session.ctx)
        await playout.process(good, session.ctx)
        frames = await collect(playout.output, 4)
        stats = playout.stats
        await session.close()
        return frames, stats

    frames, stats = asyncio.run(main())
    assert stats.invalid_chunks == 3
    assert [f.chunk for f in frames] == [0, 0, 0, 0]


def test_output_handed_in_is_the_one_released_and_closed_at_teardown():
    async def main():
        output = PlayoutOutput()
        session = await start_playout("handed", PlayoutStage(PlayoutConfig(), output), realtime_source(3))
        same = session.playout.output is output
        await session.close()
        return same, output.closed

    same, closed = asyncio.run(main())
    assert same and closed
