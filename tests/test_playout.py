"""Playout: the 24 fps clock, exact A/V spans, stall absorption, underruns, rollback, trace stamp."""

from __future__ import annotations

import asyncio
import time
from itertools import pairwise

import numpy as np
import pytest
from playout_support import start_playout

from charstream.stages.config import PlayoutConfig
from charstream.stages.egress.testcard import card_chunk
from charstream.stages.playout.output import PlayoutOutput
from charstream.stages.playout.stage import PlayoutStage
from charstream.timeline import CHARACTERS, Timeline
from charstream.transport.messages import Control, ControlKind, TraceContext, TurnStartPayload, VideoChunk

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
            delay = start + (n + 1) * CHARACTERS.chunk_seconds - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)

    return source


async def collect(output, count: int) -> list:
    """The first ``count`` frames the output releases."""
    await output.wait_started()
    return await collect_from(output, 0, count)


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
        span = expected.audio[f.frame_in_chunk * CHARACTERS.samples_per_frame:(f.frame_in_chunk + 1) * CHARACTERS.samples_per_frame]
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
    """``count`` frames from frame ``index`` on (held frames among them; skipped ones are not waited for)."""
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
        buffered = [c.chunk for c in playout.clock.buffer]
        playing = playout.last_committed
        await playout.control(Control("rollback", 1, ControlKind.TURN_START, chunk=playing + 1), session.ctx)
        stats_after = (playout.stats.rolled_back_chunks, playout.epoch, len(playout.clock.buffer))
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
    [rollback] = [c for c in r["controls"] if c.kind == ControlKind.ROLLBACK]
    assert rollback.chunk == 2 and rollback.epoch == 1
    assert rollback.payload.dropped == len(r["buffered"])
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
        silent = good.audio[:0]
        for bad in (VideoChunk("bad", 0, good.frames[0], good.audio, False),
                    VideoChunk("bad", 0, good.frames, good.audio[:100], False),
                    VideoChunk("bad", 0, good.frames.astype(np.float32), good.audio, False),
                    VideoChunk("bad", 0, good.frames[:0], good.audio, False),  # a part with no frames
                    VideoChunk("bad", 0, good.frames[1:], good.audio, False, offset=1),  # a later part with audio
                    VideoChunk("bad", 0, good.frames[1:], silent, False, offset=4),  # past the chunk's frames
                    VideoChunk("bad", 0, good.frames, silent, False, offset=1)):  # more frames than the chunk has
            await playout.process(bad, session.ctx)
        await playout.process(good, session.ctx)
        frames = await collect(playout.output, 4)
        stats = playout.stats
        await session.close()
        return frames, stats

    frames, stats = asyncio.run(main())
    assert stats.invalid_chunks == 7
    assert [f.chunk for f in frames] == [0, 0, 0, 0]


def test_a_chunk_in_parts_plays_as_one_and_a_part_without_its_chunk_is_dropped():
    """The first part (with the chunk's audio) plays as it lands; the later part continues it, each frame
    with its own audio span; a part of a chunk playout never got, or out of order, changes nothing."""

    async def main():
        session = await start_playout("parts", PlayoutStage(PlayoutConfig(target_depth_chunks=0)), realtime_source(0))
        playout = session.playout
        whole = [card_chunk("parts", n, SIZE, SIZE) for n in range(2)]
        silent = whole[0].audio[:0]
        await playout.process(VideoChunk("parts", 0, whole[0].frames[:1], whole[0].audio, False), session.ctx)
        await playout.process(VideoChunk("parts", 0, whole[0].frames[2:], silent, False, offset=2), session.ctx)
        await playout.process(VideoChunk("parts", 7, whole[0].frames[1:], silent, False, offset=1), session.ctx)
        await playout.process(VideoChunk("parts", 0, whole[0].frames[1:], silent, False, offset=1), session.ctx)
        await playout.process(whole[1], session.ctx)
        frames = await collect(playout.output, 8)
        stats = playout.stats
        await session.close()
        return whole, frames, stats

    whole, frames, stats = asyncio.run(main())
    assert [(f.chunk, f.frame_in_chunk) for f in frames] == [(c, i) for c in (0, 1) for i in range(4)]
    span = CHARACTERS.samples_per_frame
    for f in frames:
        assert np.array_equal(f.image, whole[f.chunk].frames[f.frame_in_chunk])
        assert np.array_equal(f.audio, whole[f.chunk].audio[f.frame_in_chunk * span:(f.frame_in_chunk + 1) * span])
    assert stats.invalid_chunks == 0 and stats.underruns == 0


def test_output_handed_in_is_the_one_released_and_closed_at_teardown():
    async def main():
        output = PlayoutOutput()
        session = await start_playout("handed", PlayoutStage(PlayoutConfig(), output), realtime_source(3))
        same = session.playout.output is output
        await session.close()
        return same, output.closed

    same, closed = asyncio.run(main())
    assert same and closed


def stamped(chunk: VideoChunk, latency_s: float, step_s: float) -> VideoChunk:
    """The stamps conditioning and diffusion put on every chunk: it left conditioning ``latency_s`` ago,
    its step took ``step_s``."""
    ready = time.time() - latency_s
    chunk.trace.stamps.update(conditioning_ready=ready, diffusion_done=ready + step_s)
    return chunk


def speech_chunk(n: int, onset: int, turn_id: int = 5) -> VideoChunk:
    """A chunk of the placed speech: its audio silent before the onset frame, as conditioning builds it."""
    chunk = card_chunk("turn", n, SIZE, SIZE, speaking=True, epoch=1, turn_id=turn_id)
    chunk.audio = chunk.audio.copy()
    chunk.audio[:onset * CHARACTERS.samples_per_frame] = 0
    chunk.audio[onset * CHARACTERS.samples_per_frame:] = 1000 + n
    return chunk


@pytest.mark.parametrize("latency_s,step_s,deeper", [(0.06, 0.03, 0), (0.30, 0.15, 0), (0.06, 0.03, 2)])
def test_turn_start_keeps_what_plays_before_the_speech_and_places_it_at_a_frame_on_time(latency_s, step_s, deeper):
    """No hole at a turn start: listening chunks measured to take ``latency_s`` from conditioning to
    here; the speech is placed at the first frame its chunk can reach, the chunks before it keep playing,
    and its first chunk -- made as fast as measured -- lands in time: no underrun, no held frame. The
    frames of its chunk before the onset are the listening version already made; the onset frame is
    the first speaking one (stamped), with the speech's first audio. A rewind within rollback_frames:
    the ROLLBACK never goes before ``earliest_chunk`` (``deeper``: conditioning is that many chunks further
    ahead, so the speech must wait for a later chunk to keep the rewind exact)."""
    async def upstream(session):
        playout, ctx = session.playout, session.ctx
        start, n = time.monotonic(), 0
        while not (rollbacks := [c for c in session.controls if c.kind == ControlKind.ROLLBACK]):
            if time.monotonic() >= start + (n - 2) * CHARACTERS.chunk_seconds:  # listening, 3 chunks ahead (the idle lead)
                await playout.process(stamped(card_chunk(ctx.session_id, n, SIZE, SIZE), latency_s, step_s), ctx)
                n += 1
            await asyncio.sleep(0.001)
        [rollback] = rollbacks
        await asyncio.sleep(latency_s / 2)  # its first chunk arrives inside the measured latency
        onset = rollback.payload.onset_frame
        for n in range(rollback.chunk + 1, rollback.chunk + 9):
            await playout.process(stamped(speech_chunk(n, onset if n == rollback.chunk + 1 else 0), latency_s, step_s), ctx)

    async def main():
        # a frame of allowance before any turn is measured (the default's chunk is for a live session's first
        # turn): the placement's tightness is what this checks
        config = PlayoutConfig(target_depth_chunks=2, initial_allowance_s=1 / 24)
        session = await start_playout("turn", PlayoutStage(config), upstream)
        playout = session.playout
        frames = await collect(playout.output, 4 * 6 + 1)  # six chunks and a frame
        frontier = playout.clock.buffer[-1].chunk + 1 + deeper
        sent = time.time()
        await playout.control(Control("turn", 1, ControlKind.TURN_START, chunk=frontier, epoch=0, trace=TraceContext(5),
                                      payload=TurnStartPayload(earliest_chunk=frontier - 3, last_emit_at=None, encode_s=0.0)),
                              session.ctx)
        after = await collect_from(playout.output, frames[-1].index + 1, 28)  # into the speech, not past it
        rollback = next(c for c in session.controls if c.kind == ControlKind.ROLLBACK)
        result = dict(frames=frames + after, rollback=rollback, frontier=frontier, stats=playout.stats, sent=sent)
        await session.close()
        return result

    r = asyncio.run(main())
    stats, rollback, frames = r["stats"], r["rollback"], r["frames"]
    assert stats.underruns == 0 and stats.underrun_frames == 0 and stats.late_speech == 0  # no hole
    assert all(f.chunk is not None for f in frames)
    speech_at, onset = rollback.chunk + 1, rollback.payload.onset_frame
    assert speech_at >= r["frontier"] - 3  # the rewind (frontier - speech_at) stays within rollback_frames = 3
    if deeper:
        assert (speech_at, onset) == (r["frontier"] - 3, 0)
    assert stats.kept_chunks == rollback.payload.kept and stats.kept_chunks >= (1 if latency_s > 0.2 else 0)
    # The media timeline has no gap: chunk after chunk, each frame in order, the speech's chunk
    # continuing its listening version at the onset frame.
    assert [(f.chunk, f.frame_in_chunk) for f in frames] == [(n, i) for n in range(frames[0].chunk, frames[-1].chunk + 1)
                                                             for i in range(4)][:len(frames)]
    before = [f for f in frames if f.epoch == 0]
    speech = [f for f in frames if f.epoch == 1]
    assert (speech[0].chunk, speech[0].frame_in_chunk) == (speech_at, onset)
    assert all(not f.speaking for f in before) and before[-1].index + 1 == speech[0].index
    assert all(np.array_equal(f.image, card_chunk("turn", f.chunk, SIZE, SIZE).frames[f.frame_in_chunk]) for f in before)
    [first] = [f for f in frames if f.first_speaking]
    assert first is speech[0] and first.speaking and (first.audio == 1000 + speech_at).all()
    assert first.trace.stamps["playout_first_speaking_frame"] == first.released_at
    # Placed at the first frame its chunk can reach: at least the latency after the turn start, less
    # than a frame more (plus scheduling) beyond the first turn start's one-frame allowance.
    assert latency_s + 1 / 24 <= first.released_at - r["sent"]
    # The chunk after the onset's is made a step later: it is not due before then.
    assert rollback.payload.due_at + 4 / 24 - r["sent"] >= latency_s + 1 / 24 + step_s
    assert r["sent"] <= rollback.payload.placed_at <= first.released_at  # the placement's wall clock, for the hop
    if not deeper:  # nor later than needed: the onset frame or the next chunk is at most a frame late
        assert min(first.released_at - r["sent"] - latency_s - 1 / 24,
                   rollback.payload.due_at + 4 / 24 - r["sent"] - latency_s - 1 / 24 - step_s) < 1 / 24 + 0.03



@pytest.mark.parametrize("speaking", [True, False])
def test_dry_in_the_middle_of_speech_resumes_with_the_next_chunk(speaking):
    """Speech arrives at the agent's pace, so a buffer that ran dry mid-speech cannot refill: its next
    chunk plays as it lands (listening waits for the target depth again, as before)."""
    async def main():
        session = await start_playout(f"dry{speaking}", PlayoutStage(PlayoutConfig(target_depth_chunks=1)),
                                      realtime_source(16, stall_after=6, stall_s=0.6, speaking_from=0 if speaking else None))
        frames = await collect(session.playout.output, 4 * 12)
        await session.close()
        return frames

    frames = asyncio.run(main())
    held = [i for i, f in enumerate(frames) if f.chunk is None]
    after = frames[held[-1] + 1]
    assert after.chunk == 7 and after.frame_in_chunk == 0
    # Chunk 7 lands 0.6 s late; one chunk was buffered: ~10 frames held. Waiting for depth 2 holds
    # a chunk (4 frames) longer.
    assert (len(held) <= 12) if speaking else (len(held) >= 13), len(held)


def test_a_first_turn_is_placed_with_the_configured_allowance_and_a_negative_one_is_refused():
    assert PlayoutStage(PlayoutConfig())._estimator.allowance_s == pytest.approx(4 / 24)  # one chunk by default
    assert PlayoutStage(PlayoutConfig(initial_allowance_s=0.05))._estimator.allowance_s == pytest.approx(0.05)
    with pytest.raises(ValueError, match="playout.initial_allowance_s: -0.01 is not"):
        PlayoutStage(PlayoutConfig(initial_allowance_s=-0.01))


@pytest.mark.parametrize("reader_format", [None, "yuv420p"])
def test_frames_come_in_the_video_readers_format_when_it_asks(reader_format):
    """A reader that encodes yuv420p (the WebRTC video track sets ``video_format``) gets each released frame's
    planes too, converted off the event loop as its chunk arrived: PyAV's conversion of the frame's image
    exactly (what the track would make itself); hold frames repeat the last one's. No reader, no
    conversion. The source stalls after chunk 6, so the clock holds a frame."""
    from av import VideoFrame
    from av.video.reformatter import VideoReformatter

    async def main():
        output = PlayoutOutput(timeline=CHARACTERS)
        output.video_format = reader_format
        session = await start_playout("yuv", PlayoutStage(PlayoutConfig(target_depth_chunks=1), output),
                                      realtime_source(12, stall_after=6, stall_s=0.5))
        frames = await collect(output, 60)
        stats = session.playout.stats
        await session.close()
        return frames, stats

    frames, stats = asyncio.run(main())
    fresh = [f for f in frames if f.chunk is not None]
    if reader_format is None:
        assert all(f.video is None for f in frames)
        return
    scaler = VideoReformatter()
    converted = [f for f in fresh if f.video is not None]
    assert len(converted) >= len(fresh) - 4  # a chunk's first frames may leave before its conversion is done
    for f in converted:
        want = scaler.reformat(VideoFrame.from_ndarray(f.image, format="rgb24"), format="yuv420p").to_ndarray()
        assert np.array_equal(f.video, want)
    held = [(before, f) for before, f in pairwise(frames) if f.chunk is None and before.video is not None]
    assert stats.underruns >= 1 and held, "the stall made no hold frame after a converted one"
    assert all(f.video is before.video for before, f in held)


REPHASED = Timeline(fps=50, frames_per_chunk=20)  # a chunk-motion model's grid, scaled down: 0.4 s chunks


def media_chunk(n: int, start: int, epoch: int, turn_id: int | None) -> VideoChunk:
    """Chunk ``n`` made from media frame ``start`` on: each frame carries its media frame's number in its
    first pixel and, as every sample of its audio, in its span (so a frame shown out of place shows)."""
    count, span = REPHASED.frames_per_chunk, REPHASED.samples_per_frame
    frames = np.zeros((count, SIZE, SIZE, 3), np.uint8)
    frames[:, 0, 0, 0], frames[:, 0, 0, 1] = np.arange(start, start + count) % 256, np.arange(start, start + count) // 256
    audio = np.repeat(np.arange(start, start + count), span).astype(np.int16)
    return VideoChunk("turn", n, frames, audio, turn_id is not None, epoch, TraceContext(turn_id=turn_id), start)


async def until_frame_in_chunk(output, index: int, position: int) -> list:
    """Frames from ``index`` on, up to the first one at ``position`` in its chunk: the next turn start is
    sent there, so its onset lands inside that chunk."""
    frames = await collect_from(output, index, 1)
    while frames[-1].frame_in_chunk != position:
        frames += await collect_from(output, frames[-1].index + 1, 1)
    return frames


def test_a_rephased_turn_start_restarts_the_chunk_grid_at_the_speech_without_a_gap():
    """A chunk-motion model's turn start (playout ``rephase``): the speech is placed at the first frame its
    chunk reaches, inside a chunk, not at the next boundary; the ROLLBACK says at which media frame the
    regenerated chunk starts (``start_frame``); the listening chunk plays up to there, then the speech's
    chunk from its first frame. Media frames stay consecutive, each with its own audio, across three turn
    starts -- one superseding the last before its onset (then placed at the end of the chunk playing) --
    and a barge-in (which restarts at the end of the chunk played); each turn's first speaking frame is its
    chunk's first, at the ``start_frame``, placed ones within a few frames of the measured latency."""
    latency_s, step_s, frame_s = 0.06, 0.03, REPHASED.frame_seconds

    async def upstream(session):  # conditioning, diffusion and decode: 2 chunks ahead of the playhead
        playout, ctx = session.playout, session.ctx
        epoch, phase, n, turn, seen, turns = 0, 0, 0, None, 0, iter((5, 6, 7))
        while True:
            rollbacks = [c for c in session.controls if c.kind == ControlKind.ROLLBACK]
            if len(rollbacks) > seen:
                for r in rollbacks[seen:]:  # every turn start since the last look takes its turn id
                    turn = next(turns) if r.payload.reason == ControlKind.TURN_START else None
                seen, last = len(rollbacks), rollbacks[-1]
                epoch, n = last.epoch, last.chunk + 1
                phase = last.payload.start_frame - n * REPHASED.frames_per_chunk
                await asyncio.sleep(latency_s / 2)
            if len(playout.clock.buffer) < 3:
                chunk = media_chunk(n, n * REPHASED.frames_per_chunk + phase, epoch, turn)
                await playout.process(stamped(chunk, latency_s, step_s), ctx)
                n += 1
            await asyncio.sleep(0.002)

    async def turn(session, turn_id: int) -> float:
        sent = time.time()
        await session.playout.control(Control("turn", turn_id, ControlKind.TURN_START, chunk=0, trace=TraceContext(turn_id),
                                              payload=TurnStartPayload(None, None, 0.0)), session.ctx)
        return sent

    async def main():
        config = PlayoutConfig(target_depth_chunks=2, initial_allowance_s=frame_s)
        playout = PlayoutStage(config, PlayoutOutput(config.history_frames, timeline=REPHASED), timeline=REPHASED,
                               rephase=True)
        session = await start_playout("turn", playout, upstream)
        frames = await collect(playout.output, 30)
        frames += await until_frame_in_chunk(playout.output, frames[-1].index + 1, 2)
        sent = [await turn(session, 5)]
        frames += await collect_from(playout.output, frames[-1].index + 1, 50)
        frames += await until_frame_in_chunk(playout.output, frames[-1].index + 1, 2)
        sent.append(await turn(session, 6))
        sent.append(await turn(session, 7))  # at once: turn 6's onset is still to come
        frames += await collect_from(playout.output, frames[-1].index + 1, 60)
        await playout.control(Control("turn", 7, ControlKind.INTERRUPT, chunk=0), session.ctx)
        frames += await collect_from(playout.output, frames[-1].index + 1, 50)
        rollbacks = [c for c in session.controls if c.kind == ControlKind.ROLLBACK]
        stats = playout.stats
        await session.close()
        return frames, rollbacks, sent, stats

    frames, rollbacks, sent, stats = asyncio.run(main())
    assert stats.underruns == 0 and stats.late_speech == 0
    media = [int(f.image[0, 0, 0]) + 256 * int(f.image[0, 0, 1]) for f in frames]
    assert media == list(range(media[0], media[0] + len(media)))  # no frame skipped or repeated
    assert all((f.audio == m).all() for f, m in zip(frames, media, strict=True))  # each with its own audio
    assert [r.payload.reason for r in rollbacks] == [ControlKind.TURN_START] * 3 + [ControlKind.INTERRUPT]
    for placed in rollbacks[:2]:  # placed inside the chunk on screen (sent at its third frame)
        assert placed.payload.placed_at is not None and placed.payload.onset_frame > 2 and placed.payload.kept == 0
    assert rollbacks[2].payload.placed_at is None  # turn 7 was not: the chunk playing ends first
    for rollback, turn_id, at in ((rollbacks[0], 5, sent[0]), (rollbacks[2], 7, None)):
        [first] = [(f, m) for f, m in zip(frames, media, strict=True) if f.first_speaking and f.trace.turn_id == turn_id]
        frame, number = first
        assert number == rollback.payload.start_frame and frame.frame_in_chunk == 0 and frame.chunk == rollback.chunk + 1
        if at is not None:
            assert frame.released_at - at <= latency_s + 4 * frame_s + 0.05  # not held back to a chunk boundary
    assert not any(f.first_speaking and f.trace.turn_id == 6 for f in frames)  # superseded before its onset
    barge = rollbacks[3]
    assert barge.payload.start_frame % REPHASED.frames_per_chunk == rollbacks[2].payload.start_frame % REPHASED.frames_per_chunk
    assert not any(f.speaking for f, m in zip(frames, media, strict=True) if m >= barge.payload.start_frame)
