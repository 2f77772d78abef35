"""A session on FlashHead's timeline (25 fps, 28 new frames per chunk) through playout and the WebRTC
tracks: the clock, each frame's audio span and the 90 kHz pts all follow the session's timeline, so
A/V sync holds by construction (a chunk's audio span = 28 x 1,920 samples)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from playout_support import start_playout

from charstream.pipeline.config import PipelineConfig
from charstream.pipeline.runtime.runner import Node
from charstream.pipeline.session import session_factory
from charstream.pipeline.web.client import EgressClient
from charstream.pipeline.web.server import EgressServer
from charstream.stages.config import EgressConfig, PlayoutConfig
from charstream.stages.egress.testcard import CLICK_AMPLITUDE, CardSource, card_chunk
from charstream.stages.playout.stage import PlayoutStage

FLASHHEAD = PipelineConfig(preset="flashhead-pro").timeline
SIZE = 32


def test_flashhead_session_timeline_is_25_fps_28_frames():
    assert (FLASHHEAD.fps, FLASHHEAD.frames_per_chunk) == (25, 28)
    assert FLASHHEAD.samples_per_chunk == 28 * 1_920


def test_playout_releases_28_frame_chunks_on_the_25_fps_clock_with_their_audio():
    async def source(session) -> None:
        playout, ctx = session.playout, session.ctx
        start = time.monotonic()
        for n in range(6):
            await playout.process(card_chunk(ctx.session_id, n, SIZE, SIZE, timeline=FLASHHEAD), ctx)
            delay = start + (n + 1) * FLASHHEAD.chunk_seconds - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)

    async def main():
        playout = PlayoutStage(PlayoutConfig(target_depth_chunks=1), timeline=FLASHHEAD)
        session = await start_playout("fh", playout, source)
        output = playout.output
        await output.wait_started()
        frames, index = [], 0
        while len(frames) < 3 * 28:
            frame = await output.frame_at(index)
            frames.append(frame)
            index = frame.index + 1
        stats = playout.stats
        await session.close()
        return frames, stats

    frames, stats = asyncio.run(main())
    assert [f.index for f in frames] == list(range(84))
    assert [f.chunk for f in frames] == [n for n in range(3) for _ in range(28)]  # 28 new frames a chunk
    for f in frames:  # each frame is its chunk's frame with exactly its 1,920 samples
        sent = card_chunk("fh", f.chunk, SIZE, SIZE, timeline=FLASHHEAD)
        assert sent.audio.shape == (53_760,)
        assert np.array_equal(f.image, sent.frames[f.frame_in_chunk])
        assert np.array_equal(f.audio, sent.audio[f.frame_in_chunk * 1_920:(f.frame_in_chunk + 1) * 1_920])
    lateness = [f.released_at - frames[0].released_at - f.index / 25 for f in frames]
    assert max(lateness) - min(lateness) < 0.1  # released on the 25 fps clock, not 24
    assert stats.underruns == 0


def test_a_24_fps_chunk_is_refused_by_a_25_fps_playout():
    async def source(session) -> None:
        await session.playout.process(card_chunk(session.ctx.session_id, 0, SIZE, SIZE), session.ctx)

    async def main():
        playout = PlayoutStage(PlayoutConfig(), timeline=FLASHHEAD)
        session = await start_playout("fh-bad", playout, source)
        await asyncio.sleep(0.2)
        stats = playout.stats
        await session.close()
        return stats

    assert asyncio.run(main()).invalid_chunks == 1


@pytest.fixture(scope="module")
def over_webrtc():
    """A 25 fps test-card session (its timeline from the FlashHead config) to the in-process aiortc client."""

    async def main():
        config = PipelineConfig(preset="flashhead-pro", playout=PlayoutConfig(target_depth_chunks=1))
        factory = session_factory(config, testcard=Node("card", CardSource, {"listen": False, "flash_every": 1,
                                                                             "timeline": config.timeline}))
        server = EgressServer(EgressConfig(port=0), factory)
        url = await server.start()
        session_id, token = server.create_session()
        client = EgressClient(keep_images=True, fps=25)
        await client.connect(url, token)
        await client.wait_for_video(1, timeout=30)
        await asyncio.sleep(6.0)
        peer = server.sessions[session_id]
        result = dict(video=list(client.video), audio=list(client.audio), client=client,
                      indices=[peer.video.frame_index(v.rtp) for v in client.video])
        await client.close()
        await server.stop()
        return result

    return asyncio.run(main())


def test_client_gets_25_fps_at_3600_ticks_a_frame(over_webrtc):
    arrivals = np.array([v.arrival for v in over_webrtc["video"]])
    window = arrivals[(arrivals >= arrivals[0] + 1.0) & (arrivals < arrivals[0] + 5.0)]
    assert abs(len(window) / 4.0 - 25) <= 1.0
    steps = np.diff(np.array([v.rtp for v in over_webrtc["video"]], np.int64)) % 2**32
    assert steps.min() >= 3598 and steps.max() <= 3602  # 90 kHz / 25, consecutive frames


def test_audio_and_video_of_a_chunk_start_together_at_the_client(over_webrtc):
    """Every chunk's first frame flashes and its audio starts with a click: at the client they line up
    within one 25 fps frame."""
    client = over_webrtc["client"]
    flashes = [v for v, i in zip(over_webrtc["video"], over_webrtc["indices"], strict=True)
               if i is not None and i % 28 == 0 and v.image.mean() > 200]
    assert flashes
    clicks = [(a, int(np.argmax(np.abs(a.samples) > CLICK_AMPLITUDE // 3))) for a in over_webrtc["audio"]
              if (np.abs(a.samples) > CLICK_AMPLITUDE // 3).any()]
    times = [client.sender_time("audio", a.rtp + i) for a, i in clicks]
    offsets = []
    for flash in flashes:
        video_at = client.sender_time("video", flash.rtp)
        offsets.append(min(times, key=lambda t: abs(t - video_at)) - video_at)
    assert max(abs(o) for o in offsets) <= 1 / 25, offsets


def test_a_flashhead_model_session_without_a_portrait_is_refused_in_one_line():
    from charstream.pipeline.session import model_nodes

    with pytest.raises(ValueError, match="'flashhead-pro' animates a portrait: give one"):
        model_nodes(PipelineConfig(preset="flashhead-pro"))


@pytest.mark.parametrize("ready, step, expected", [(2, 0.5, (0, 25, 2)), (30, 0.5, (0, 26, 2)), (28, 0.5, (0, 26, 0)),
                                                   (60, 0.5, (1, 27, 4)), (2, 36, (0, 25, 10))])
def test_a_chunk_motion_turn_starts_at_the_first_frame_its_chunk_reaches(ready, step, expected):
    """Speech placed for a chunk-motion model (``rephase``) starts at the first frame its first chunk reaches,
    inside a chunk (28-frame chunks; chunk 25 on screen at its first frame, 26.. buffered), where the
    characters family's placement would have to reach the next boundary with the chunk after; its next
    chunk, made ``step`` frames later, is due a whole chunk after the onset."""
    from charstream.stages.playout.onset import Onset, Playhead, place_speech
    from charstream.stages.playout.speech_estimate import Estimate
    from charstream.transport.messages import TurnStartPayload

    step_s = step / FLASHHEAD.fps
    estimate = Estimate(starts_s=(ready - 0.5) / FLASHHEAD.fps - step_s, step_s=step_s, delivery_s=0.0, allowance_s=0.0)
    playhead = Playhead(t0=0.0, next_index=100, on_screen=25, position=0, next_chunk=26, buffered=3, timeline=FLASHHEAD)
    turn_start = TurnStartPayload(earliest_chunk=None, last_emit_at=None, encode_s=0.0)
    assert place_speech(estimate, turn_start, playhead, 100 / FLASHHEAD.fps, rephase=True) == Onset(*expected, estimate)
    if step == 36:  # in place, the next chunk is due at the next boundary: the speech waits for frame 28
        assert place_speech(estimate, turn_start, playhead, 100 / FLASHHEAD.fps) == Onset(0, 26, 0, estimate)
