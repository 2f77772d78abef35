"""Cross-session batching of the decoder at the stage level: the scheduler both model stages share
(stages/shared/batcher.py: due set, window, one pending item per session, failures routed to the sessions
they hit, a session leaving while its item waits), decode stages sharing a ``DecodeBatcher``
(stages/decode/batcher.py) emitting their unbatched frames through a rollback, an epoch-ahead chunk
and a session leaving and another joining, and real inproc sessions with both batchers releasing the
frames they release unbatched."""

from __future__ import annotations

import argparse
import asyncio
import threading

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
from structlog.testing import capture_logs

from charstream.model.config import TINY
from charstream.pipeline.config import PipelineConfig
from charstream.stages.config import DecodeConfig
from charstream.stages.decode.batcher import DecodeBatcher
from charstream.stages.decode.stage import DecodeStage
from charstream.stages.diffusion.batcher import StepBatcher
from charstream.stages.shared.batcher import SessionBatcher
from charstream.timeline import CHARACTERS
from charstream.transport.messages import Latents

# -- the scheduler ------------------------------------------------------------------------------------


class _Doubler(SessionBatcher):
    """The smallest real batcher: doubles each item; refuses None alone; a negative item fails its forward."""

    def __init__(self, window_s: float) -> None:
        super().__init__(4, window_s)
        self.batches: list[list[int]] = []

    def check(self, key, item) -> None:
        if item is None:
            raise ValueError("refused on its own")

    def forward(self, keys, items):
        self.batches.append(list(items))
        if any(i < 0 for i in items):
            raise RuntimeError("the forward failed")
        return [2 * i for i in items]


def _opened(window_s: float, sessions: int) -> tuple[_Doubler, list[object]]:
    """A doubler with ``sessions`` sessions open, and a key for each."""
    b = _Doubler(window_s)
    for _ in range(sessions):
        b.opened()
    return b, [object() for _ in range(sessions)]


def test_prepare_runs_on_each_new_worker_thread_before_its_first_forward():
    class Prepared(_Doubler):
        def prepare(self) -> None:
            self.batches.append(["prepared", threading.current_thread().name])

    async def main():
        b = Prepared(0.0)
        key = object()
        with capture_logs() as logs, anyio.fail_after(10):
            b.opened()
            assert await b.submit(key, 3) == 6
        [prepared] = [e for e in logs if e["event"] == "batcher_prepared"]  # how long the first session waited
        assert prepared["batcher"] == "batcher" and prepared["seconds"] >= 0
        b.closed(key)
        assert worker_ended(b)
        b.opened()  # a new worker thread prepares again
        with anyio.fail_after(10):
            assert await b.submit(key, 4) == 8
        b.closed(key)
        assert b.batches == [["prepared", "batcher"], [3], ["prepared", "batcher"], [4]]

    asyncio.run(main())


def test_a_failed_prepare_leaves_the_forwards_to_run():
    class Unprepared(_Doubler):
        def prepare(self) -> None:
            raise RuntimeError("no warm-up")

    async def main():
        b = Unprepared(0.0)
        b.opened()
        with anyio.fail_after(10):
            assert await b.submit(object(), 5) == 10

    asyncio.run(main())


def test_the_scheduler_batches_what_is_due_and_routes_each_failure_to_its_sessions():
    async def main():
        b, keys = _opened(30.0, 3)
        # every open session has one in: one forward at once, not after the 30 s window
        with anyio.fail_after(10):
            got = await asyncio.gather(*(b.submit(k, i) for i, k in enumerate(keys)))
        assert got == [0, 2, 4] and b.batches == [[0, 1, 2]]
        first = asyncio.ensure_future(b.submit(keys[0], 7))
        await asyncio.sleep(0)
        with pytest.raises(RuntimeError, match="previous item is pending"):
            await b.submit(keys[0], 8)
        with anyio.fail_after(10):
            assert await asyncio.gather(first, b.submit(keys[1], 1), b.submit(keys[2], 2)) == [14, 2, 4]
        # one refused alone, two sharing a failed forward: each hears its own outcome
        results = await asyncio.gather(b.submit(keys[0], None), b.submit(keys[1], 3), b.submit(keys[2], -1),
                                       return_exceptions=True)
        assert isinstance(results[0], ValueError)
        assert all(isinstance(r, RuntimeError) and "forward failed" in str(r) for r in results[1:])
        # a session leaving while its item waits: dropped, and the others are not held by it any more
        waiting = asyncio.ensure_future(b.submit(keys[0], 5))
        await asyncio.sleep(0.05)
        assert not waiting.done()  # keys[1] and keys[2] have nothing in: the forward waits for them
        b.closed(keys[0])
        with pytest.raises(asyncio.CancelledError):
            await waiting
        with anyio.fail_after(10):
            assert await asyncio.gather(b.submit(keys[1], 5), b.submit(keys[2], 6)) == [10, 12]
        b.closed(keys[1])
        b.closed(keys[2])
        return b

    b = asyncio.run(main())
    assert b._open == 0 and worker_ended(b)
    assert len(b.batches) == 4 and b.batches[2] == [3, -1]  # the refused item never reached a forward
    assert b.stats.forwards == 3 and b.stats.steps == 8  # the failed forward served no one


def test_a_full_forward_goes_at_once_when_more_sessions_are_open_than_it_takes():
    async def main():
        b, keys = _opened(30.0, 6)  # takes 4 per forward
        with anyio.fail_after(10):  # 5 of 6 in: the first 4 go at once, not after the window
            first = [asyncio.ensure_future(b.submit(k, i)) for i, k in enumerate(keys[:5])]
            while sum(f.done() for f in first) < 4:
                await asyncio.sleep(0.01)
        last = first[4]
        assert b.batches == [[0, 1, 2, 3]] and not last.done()  # the fifth waits: 1 of a forward of 4 in
        with anyio.fail_after(10):  # three more make a full forward: it goes at once
            got = await asyncio.gather(last, b.submit(keys[5], 5), b.submit(keys[0], 6), b.submit(keys[1], 7))
        assert got == [8, 10, 12, 14]
        for k in keys:
            b.closed(k)
        return b

    b = asyncio.run(main())
    assert b.batches == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_the_window_lets_a_forward_go_without_a_silent_session():
    async def main():
        b, keys = _opened(0.2, 3)
        started = asyncio.get_running_loop().time()
        got = await asyncio.gather(b.submit(keys[0], 1), b.submit(keys[1], 2))  # keys[2] stays silent
        waited = asyncio.get_running_loop().time() - started
        for k in keys:
            b.closed(k)
        return got, waited, b

    got, waited, b = asyncio.run(main())
    assert got == [2, 4] and b.batches == [[1, 2]] and 0.15 < waited < 2.0


# -- decode stages sharing a batcher ------------------------------------------------------------------


def _latents(name: str, chunk: int, epoch: int) -> Latents:
    rng = np.random.default_rng([ord(c) for c in name] + [chunk, epoch])
    z = rng.standard_normal((TINY.latent_channels, TINY.latent_height, TINY.latent_width)).astype(np.float32)
    return Latents(name, chunk, z, np.zeros(CHARACTERS.samples_per_chunk, np.int16), epoch > 0, epoch)


# ("l", chunk, epoch) latents reach the stage, ("r", last committed, epoch) a ROLLBACK. "b" rolls back to
# chunk 2 and decodes 3, 4 again in epoch 1; "a" gets a chunk of an epoch no ROLLBACK announced (its
# control was overtaken); "c" leaves after 3 chunks and "d" joins then.
PLANS = {
    "a": [("l", n, 0) for n in range(3)] + [("l", 3, 1)],
    "b": [("l", n, 0) for n in range(5)] + [("r", 2, 1)] + [("l", n, 1) for n in (3, 4)],
    "c": [("l", n, 0) for n in range(3)],
    "d": [("l", n, 0) for n in range(3)],
}


async def _decode_plan(name: str, batcher: DecodeBatcher | None, config: DecodeConfig) -> list[tuple[int, int, np.ndarray]]:
    stage, out = DecodeStage(config, "tiny", batcher=batcher), []
    await play_plan(stage, recording_context("decode", name, out), PLANS[name],
                    lambda chunk, epoch: _latents(name, chunk, epoch))
    assert stage.stats.gaps == 0
    return [(m.chunk, m.epoch, m.frames) for m in out]


def test_decode_stages_sharing_a_batcher_emit_their_unbatched_frames():
    config = DecodeConfig()
    batched = DecodeConfig(batch_sessions=3, batch_window_s=0.5)
    batcher = DecodeBatcher(batched, "tiny")

    alone, together = anyio.run(alone_then_together, _decode_plan, PLANS, batcher, config, batched)
    assert_emitted_alike(alone, together)
    assert [(c, e) for c, e, _ in alone["b"]][-2:] == [(3, 1), (4, 1)]
    assert not np.array_equal(alone["b"][3][2], alone["b"][5][2])  # chunk 3 again, from other latents
    assert batcher.stats.largest == 3 and batcher.stats.steps == sum(len(v) for v in together.values())
    assert batcher.stats.forwards < batcher.stats.steps  # chunks really shared forwards
    assert batcher._open == 0 and worker_ended(batcher)
    with pytest.raises(ValueError, match="decode batcher serves tiny"):
        DecodeStage(batched, "tiny", weights=None, batcher=batcher)


def test_a_chunk_refused_on_its_own_fails_only_its_session():
    config = DecodeConfig(batch_sessions=2, batch_window_s=0.5)
    batcher = DecodeBatcher(config, "tiny")

    async def main():
        x, y = object(), object()
        await anyio.to_thread.run_sync(batcher.join, x)
        await anyio.to_thread.run_sync(batcher.join, y)
        z = _latents("x", 0, 0).latents
        results = await asyncio.gather(batcher.decode(x, z[:, :2], None), batcher.decode(y, z, None),
                                       return_exceptions=True)
        batcher.leave(x)
        batcher.leave(y)
        return results

    (bad, good) = anyio.run(main)
    assert isinstance(bad, ValueError) and "expected (8, 16, 16)" in str(bad)
    frames, state = good
    assert frames.shape == (4, 128, 128, 3) and frames.dtype == np.uint8 and state.frames == 1


def test_real_sessions_with_both_batchers_release_their_unbatched_frames():
    """Three inproc sessions with their diffusion steps and decoding batched release the frames the
    same sessions release unbatched."""
    alone = asyncio.run(released_frames(seeded_configs(1, 1), 24))  # 6 chunks
    configs = seeded_configs(3, 3)
    decode_batcher = DecodeBatcher(configs[0].decode, configs[0].preset)
    together = asyncio.run(released_frames(configs, 24, StepBatcher(configs[0].diffusion, configs[0].preset),
                                           decode_batcher))
    assert_same_frames(together, alone, at_least=16)
    assert decode_batcher.stats.largest >= 2 and decode_batcher._open == 0


def test_serve_and_session_factory_make_one_batcher_per_stage_for_their_sessions():
    from charstream.pipeline import serve
    from charstream.pipeline.session import session_factory

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    config = serve.load_config(parser.parse_args(["--batch-sessions", "8"]))
    assert config.diffusion.batch_sessions == config.decode.batch_sessions == 8
    factory = session_factory(config, weights=None)
    assert isinstance(factory.batcher, StepBatcher) and factory.batcher.max_sessions == 8
    assert isinstance(factory.decode_batcher, DecodeBatcher) and factory.decode_batcher.max_sessions == 8
    config = PipelineConfig()
    config.decode.batch_sessions = 4  # decode alone batched: diffusion stays per session
    factory = session_factory(config)
    assert factory.batcher is None and factory.decode_batcher.max_sessions == 4
    off = session_factory(PipelineConfig())  # 1: off
    assert off.batcher is None and off.decode_batcher is None
    with pytest.raises(ValueError, match="decode.batch_sessions: 0 is not"):  # refused as it is set
        config.decode.batch_sessions = 0
    with pytest.raises(ValueError, match="diffusion.batch_sessions: 0 is not"):
        PipelineConfig().diffusion.batch_sessions = 0


