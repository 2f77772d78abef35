"""Playout's underruns by cause: each cause forced, counted where the underrun is decided."""

from __future__ import annotations

import asyncio
import time

import pytest
import structlog.testing
from playout_support import start_playout
from test_playout import SIZE, collect, collect_from, realtime_source, stamped

from charstream.stages.config import PlayoutConfig
from charstream.stages.egress.testcard import card_chunk
from charstream.stages.playout.stage import PlayoutStage
from charstream.stages.playout.stats import UNDERRUN_CAUSES
from charstream.timeline import CHUNK_SECONDS
from charstream.transport.messages import Control, ControlKind, TraceContext, TurnStartPayload


def by_cause(stats) -> dict[str, tuple[int, int]]:
    return {c: (stats.by_cause[c].count, stats.by_cause[c].frames) for c in UNDERRUN_CAUSES}


@pytest.mark.parametrize("speaking", [True, False])
def test_a_stall_is_counted_as_speech_or_listening(speaking):
    """A 0.6 s stall after chunk 6 holds ~10 frames: mid-speech when the chunks speak, else while listening."""
    async def main():
        session = await start_playout(f"cause{speaking}", PlayoutStage(PlayoutConfig(target_depth_chunks=1)),
                                      realtime_source(16, stall_after=6, stall_s=0.6, speaking_from=0 if speaking else None))
        frames = await collect(session.playout.output, 4 * 12)
        stats = session.playout.stats
        await session.close()
        return frames, stats

    frames, stats = asyncio.run(main())
    held = sum(f.chunk is None for f in frames)
    cause = "speech" if speaking else "listening"
    counts = by_cause(stats)
    assert counts[cause][0] >= 1 and counts[cause][1] >= held >= 8
    assert all(v == (0, 0) for c, v in counts.items() if c != cause), counts
    assert stats.underruns == counts[cause][0] and stats.underrun_frames == counts[cause][1]


@pytest.mark.parametrize("placed", [True, False])
def test_speech_late_at_its_turn_start_is_an_onset_underrun(placed):
    """The turn's first speech chunk comes 0.5 s after the rollback, well after its frame: an onset
    underrun (``placed``: at the frame the estimate chose; else a turn start with no detail, which drops
    every unplayed chunk) -- and no other cause counted, also not for the speech that then plays on."""
    async def upstream(session):
        playout, ctx = session.playout, session.ctx
        start, n = time.monotonic(), 0
        while not (rollbacks := [c for c in session.controls if c.kind == ControlKind.ROLLBACK]):
            if time.monotonic() >= start + (n - 2) * CHUNK_SECONDS:  # listening, 3 chunks ahead
                await playout.process(stamped(card_chunk(ctx.session_id, n, SIZE, SIZE), 0.05, 0.02), ctx)
                n += 1
            await asyncio.sleep(0.001)
        [rollback] = rollbacks
        await asyncio.sleep(0.5)
        for n in range(rollback.chunk + 1, rollback.chunk + 9):  # then the rest at once (as synthesised)
            await playout.process(stamped(card_chunk(ctx.session_id, n, SIZE, SIZE, speaking=True, epoch=1, turn_id=5),
                                          0.05, 0.02), ctx)

    async def main():
        session = await start_playout(f"onset{placed}", PlayoutStage(PlayoutConfig(target_depth_chunks=2)), upstream)
        playout = session.playout
        frames = await collect(playout.output, 4 * 6)
        frontier = playout.clock.buffer[-1].chunk + 1
        payload = TurnStartPayload(earliest_chunk=frontier - 3, last_emit_at=None, encode_s=0.0) if placed else None
        await playout.control(Control("onset", 1, ControlKind.TURN_START, chunk=frontier, epoch=0, trace=TraceContext(5),
                                      payload=payload), session.ctx)
        after = await collect_from(playout.output, frames[-1].index + 1, 4 * 8)
        stats = playout.stats
        await session.close()
        return after, stats

    after, stats = asyncio.run(main())
    counts = by_cause(stats)
    held = sum(f.chunk is None for f in after)
    assert counts["onset"][0] == 1 and counts["onset"][1] == held >= 6, counts
    assert counts["speech"] == (0, 0) and counts["listening"] == (0, 0), counts
    assert stats.late_speech == (1 if placed else 0)  # a placed speech chunk after its frame is late speech too
    assert [f.speaking for f in after if f.chunk is not None][-4:] == [True] * 4  # then the speech plays on


def test_a_first_turn_later_than_its_estimate_raises_the_next_turns_allowance_only():
    """Three turn starts: the first turn's speech chunks come 0.3 s after its estimate, the next
    ones as measured. The second placement adds what the first took beyond its estimate;
    the third only what the second took (on time): the first turn's errors are not kept."""
    delays = [0.3, 0.0, 0.0]

    async def upstream(session):
        playout, ctx = session.playout, session.ctx
        start, n, epoch, seen = time.monotonic(), 0, 0, 0
        while seen < len(delays):
            rollbacks = [c for c in session.controls if c.kind == ControlKind.ROLLBACK]
            if len(rollbacks) > seen:
                rollback = rollbacks[seen]
                await asyncio.sleep(delays[seen])
                epoch, n = rollback.epoch, rollback.chunk + 1
                for _ in range(4):  # the turn's speech, then listening again
                    await playout.process(stamped(card_chunk(ctx.session_id, n, SIZE, SIZE, speaking=True, epoch=epoch,
                                                             turn_id=10 + seen), 0.05, 0.02), ctx)
                    n += 1
                seen += 1
                start = time.monotonic() - (n - 2) * CHUNK_SECONDS
            if time.monotonic() >= start + (n - 2) * CHUNK_SECONDS:  # listening, 3 chunks ahead
                await playout.process(stamped(card_chunk(ctx.session_id, n, SIZE, SIZE, epoch=epoch), 0.05, 0.02), ctx)
                n += 1
            await asyncio.sleep(0.001)

    async def main():
        with structlog.testing.capture_logs() as logs:
            # a frame before any turn is measured: what the turns' errors then do to it is what this checks
            config = PlayoutConfig(target_depth_chunks=2, initial_allowance_s=1 / 24)
            session = await start_playout("allow", PlayoutStage(config), upstream)
            playout = session.playout
            index = (await collect(playout.output, 4 * 6))[-1].index + 1
            for turn in range(len(delays)):
                frontier = playout.clock.buffer[-1].chunk + 1
                await playout.control(Control("allow", turn, ControlKind.TURN_START, chunk=frontier, epoch=playout.epoch,
                                              trace=TraceContext(10 + turn),
                                              payload=TurnStartPayload(earliest_chunk=frontier - 3, last_emit_at=None,
                                                                       encode_s=0.0)), session.ctx)
                index = (await collect_from(playout.output, index, 4 * 12))[-1].index + 1
            await session.close()
        return logs

    logs = asyncio.run(main())
    allowance = [e["allowance_ms"] for e in logs if e["event"] == "playout_rollback"]
    turns = [e for e in logs if e["event"] == "playout_turn_speech"]
    assert len(allowance) == 3 and len(turns) == 3, (allowance, turns)
    assert allowance[0] == pytest.approx(1e3 / 24, abs=0.1)  # a frame before any turn was measured
    # its second latest chunk's error (the ones after its first came in a burst, less and less late)
    assert turns[0]["first_error_ms"] >= 250 and 100 < allowance[1] <= turns[0]["max_error_ms"] + 0.1
    # the third: the second turn's errors, or the prior halved twice where larger -- not the first turn's
    assert turns[1]["max_error_ms"] < 50 and allowance[2] <= max(1e3 / 24 / 4, turns[1]["max_error_ms"]) + 0.1
