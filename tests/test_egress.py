"""Egress over real aiortc on loopback: rate, A/V sync, stall absorption, turn timing, bad input."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import numpy as np
import pytest
from waiting import until

from charstream.pipeline.config import PipelineConfig
from charstream.pipeline.runtime.runner import Node
from charstream.pipeline.session import session_factory
from charstream.pipeline.web.client import AudioSamplesTrack, EgressClient, SignalingError
from charstream.pipeline.web.server import EgressServer
from charstream.stages.base import Stage
from charstream.stages.config import EgressConfig, PlayoutConfig
from charstream.stages.egress.testcard import CLICK_AMPLITUDE, CardSource, card_chunk, frame_image
from charstream.timeline import CHARACTERS, TIMELINE_RATE

FLASH_EVERY = 12  # chunks: one flash + click every 2 s
STALL_AFTER, STALL_S = 30, 0.263
TURN_CHUNK = 40  # first speaking chunk of turn 1


class StagedCard(Stage):
    """Test card at the media rate, a 263 ms upstream stall after chunk 30, speech from chunk 40 (a
    session graph's source, in place of the model stages)."""

    name = "card"

    def __init__(self, user_audio=None) -> None:
        self.turn_stamps: dict[str, float] = {}

    async def run(self, ctx) -> None:
        start = time.monotonic()
        n = 0
        while True:
            speaking = n >= TURN_CHUNK
            chunk = card_chunk(ctx.session_id, n, flash=n % FLASH_EVERY == 0, speaking=speaking,
                               turn_id=1 if speaking else None)
            if n == TURN_CHUNK:  # what ingest/conditioning would have stamped on the turn
                now = time.time()
                self.turn_stamps.update(user_speech_end=now - 0.9, agent_first_audio=now - 0.4)
                chunk.trace.stamps.update(self.turn_stamps)
            await ctx.emit(chunk)
            if n == STALL_AFTER:
                start += STALL_S
            n += 1
            delay = start + n * CHARACTERS.chunk_seconds - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)


def quiet_card():
    """Test-card sessions whose card does not listen: the mic queue is read by the test itself."""
    return session_factory(PipelineConfig(), testcard=Node("card", CardSource, {"listen": False}))


@pytest.fixture(scope="module")
def ten_seconds():
    """One 11.5 s session over loopback; the tests below check different things it recorded."""

    async def main():
        config = PipelineConfig(playout=PlayoutConfig(target_depth_chunks=2))
        factory = session_factory(config, testcard=Node("card", StagedCard))
        server = EgressServer(EgressConfig(port=0), factory)
        url = await server.start()
        session_id, token = server.create_session()
        client = EgressClient(keep_images=True)
        await client.connect(url, token)
        await client.wait_for_video(1, timeout=30)
        await asyncio.sleep(11.5)
        peer = server.sessions[session_id]
        playout = factory.sessions[session_id].stages["playout"]
        result = dict(video=list(client.video), audio=list(client.audio), client=client, turns=list(client.turns),
                      stats=playout.stats.summary(), delivery_ms=peer.timing.median_delivery_ms(),
                      turn_segments=dict(peer.turn_segments), reports=peer.timing.frames_reported,
                      unmatched=peer.timing.unmatched_reports,
                      indices=[peer.video.frame_index(v.rtp) for v in client.video])
        await client.close()
        await server.stop()
        result["left"] = (dict(server.sessions), dict(factory.sessions))
        return result

    return asyncio.run(main())


def test_client_receives_24_fps_over_10_s(ten_seconds):
    arrivals = np.array([v.arrival for v in ten_seconds["video"]])
    window = arrivals[(arrivals >= arrivals[0] + 1.0) & (arrivals < arrivals[0] + 11.0)]
    assert abs(len(window) / 10.0 - 24) <= 0.5
    rtp = np.array([v.rtp for v in ten_seconds["video"]], np.int64)
    steps = np.diff(rtp) % 2**32  # consecutive frames (±1 tick of decoder rounding): none skipped or repeated
    assert steps.min() >= 3748 and steps.max() <= 3752


def test_the_client_sees_the_colours_that_were_sent(ten_seconds):
    """The track converts each RGB frame to the encoder's yuv420p itself: the decoded colour bars,
    moving bar and digits match the card's own frame at the index the RTP timestamp names."""
    errors = []
    for received, index in zip(ten_seconds["video"], ten_seconds["indices"], strict=True):
        chunk, i = divmod(index, CHARACTERS.frames_per_chunk)
        sent = frame_image(index, 128, 128, flash=chunk % FLASH_EVERY == 0 and i == 0, speaking=chunk >= TURN_CHUNK)
        errors.append(np.abs(received.image.astype(int) - sent.astype(int)).mean())
    assert len(errors) > 200 and np.median(errors) < 6, np.percentile(errors, [50, 90, 99])


def test_audio_video_offset_at_the_client_is_within_one_frame(ten_seconds):
    client = ten_seconds["client"]
    flashes = [v for v in ten_seconds["video"] if v.image.mean() > 200]
    assert len(flashes) >= 4
    offsets = []
    for flash in flashes:
        video_at = client.sender_time("video", flash.rtp)
        clicks = [(a, int(np.argmax(np.abs(a.samples) > CLICK_AMPLITUDE // 3))) for a in ten_seconds["audio"]
                  if (np.abs(a.samples) > CLICK_AMPLITUDE // 3).any()]
        # the click nearest in media time to this flash (by sender-report mapped times)
        times = [client.sender_time("audio", a.rtp + i) for a, i in clicks]
        audio_at = min(times, key=lambda t: abs(t - video_at))
        offsets.append(audio_at - video_at)
    print("A/V offsets (ms):", [round(o * 1e3, 1) for o in offsets])
    assert max(abs(o) for o in offsets) <= 1 / 24


def test_263ms_stall_with_two_chunk_buffer_causes_no_underrun(ten_seconds):
    stats = ten_seconds["stats"]
    assert stats["underruns"] == 0 and stats["underrun_frames"] == 0 and stats["late_chunks"] == 0
    assert stats["frames_released"] > 11 * 24


def test_client_reports_give_delivery_and_the_turns_client_stamp(ten_seconds):
    assert ten_seconds["reports"] >= 200 and ten_seconds["unmatched"] < 10
    assert 0 < ten_seconds["delivery_ms"] < 500
    [turn] = ten_seconds["turns"]  # the server told the client the turn's latency segments
    assert turn["turn_id"] == 1 and set(turn["segments_ms"]) == {"agent", "pipeline", "delivery", "total"}
    assert turn["segments_ms"] == ten_seconds["turn_segments"][1]
    assert 0 < turn["segments_ms"]["delivery"] < 500
    assert ten_seconds["left"] == ({}, {})  # server stop released every session


def test_h264_is_negotiated_when_configured():
    async def main():
        factory = quiet_card()
        server = EgressServer(EgressConfig(port=0, codec="H264"), factory)
        url = await server.start()
        _, token = server.create_session()
        client = EgressClient(keep_images=True)
        await client.connect(url, token)
        await client.wait_for_video(24, timeout=30)
        answer = client.pc.remoteDescription.sdp
        frame = client.video[-1].image
        await client.close()
        await server.stop()
        return answer, frame

    answer, frame = asyncio.run(main())
    video_section = answer[answer.index("m=video"):]
    assert "H264/90000" in video_section and "VP8/90000" not in video_section
    assert frame.shape == (128, 128, 3) and frame.std() > 20  # the colour bars, decoded


def test_client_keeps_a_bounded_window_and_counts_everything():
    """The client's frame records stay within ``kept_s`` of media however long the session runs
    (a 30-minute soak grew by every frame's record); the counts still cover every frame."""

    async def main():
        factory = quiet_card()
        server = EgressServer(EgressConfig(port=0), factory)
        url = await server.start()
        _, token = server.create_session()
        client = EgressClient(kept_s=0.5)
        await client.connect(url, token)
        await client.wait_for_video(3 * 24, timeout=30)
        audio_in = await until(lambda: client.audio_samples >= 3 * TIMELINE_RATE, timeout=10)
        seen = dict(video=len(client.video), frames=client.video_frames, audio=len(client.audio),
                    samples=client.audio_samples, audio_in=audio_in)
        await client.close()
        await server.stop()
        return seen

    seen = asyncio.run(main())
    assert seen["video"] == 12 and seen["frames"] >= 72  # the last 0.5 s of 3+ s received
    assert seen["audio_in"] and seen["audio"] == 25 and seen["samples"] >= 3 * TIMELINE_RATE


def test_bad_input_is_refused_and_other_sessions_keep_running():
    async def post(http, url, path, body, headers=None):
        async with http.post(url + path, data=body, headers=headers or {}) as r:
            return r.status, await r.json()

    async def main():
        factory = quiet_card()  # the mic queue is read here instead (the browser test runs the VAD)
        calls = []

        async def counting_factory(session_id):
            calls.append(session_id)
            return await factory(session_id)

        server = EgressServer(EgressConfig(port=0, client_timeout_s=1.5, ping_interval_s=0.25), counting_factory,
                              access_key="k")
        url = await server.start()
        out = {}
        async with aiohttp.ClientSession() as http:
            out["not_json"] = await post(http, url, "/offer", "{nope")
            out["missing"] = await post(http, url, "/offer", json.dumps({"sdp": "x"}))
            out["wrong_token"] = await post(http, url, "/offer", json.dumps({"token": "t", "sdp": "x", "type": "offer"}))
            out["no_key"] = await post(http, url, "/session", "{}")
            out["key"] = await post(http, url, "/session", "{}", {"X-Charstream-Key": "k"})
            out["bad_sdp"] = await post(http, url, "/offer", json.dumps(
                {"token": out["key"][1]["token"], "sdp": "v=0\r\nthis is not sdp", "type": "offer"}))
            out["after_bad_sdp"] = dict(server.sessions)
            out["factory_calls_after_bad_sdp"] = len(calls)

        speech = (3000 * np.sin(2 * np.pi * 220 * np.arange(TIMELINE_RATE) / TIMELINE_RATE)).astype(np.int16)
        a = EgressClient(mic=AudioSamplesTrack(speech, loop=True))
        b = EgressClient()
        id_a, token_a = server.create_session()
        id_b, token_b = server.create_session()
        await a.connect(url, token_a)
        await b.connect(url, token_b)
        await a.wait_for_video(12, timeout=30)
        await b.wait_for_video(12, timeout=30)
        try:  # the same offer again: a replay
            await b_replay(url, token_a, a)
        except SignalingError as e:
            out["replay"] = e.status
        a.channel.send("not json at all")
        a.channel.send(json.dumps({"type": "frames", "frames": [[1, 2], ["x", 3]]}))
        a.channel.send(json.dumps(["a", "list"]))
        a.channel.send('{"type": "frames", "frames": [[NaN, 1]]}')
        a.channel.send(json.dumps({"type": "frames", "frames": [[1, 2]] * 49}))  # more than a report holds
        a.channel.send(json.dumps({"type": "frame", "rtp": 1, "presented_ms": 2}))  # one a message: not the protocol
        b.silent = True  # b vanishes without closing
        out["b_closed"] = await until(lambda: id_b not in server.sessions and id_b not in factory.sessions, 15, poll_s=0.05)
        frames_before = a.video_frames
        await asyncio.sleep(1.0)
        out["a_still_streaming"] = a.video_frames - frames_before
        out["a_bad_messages"] = server.sessions[id_a].bad_messages
        mic = server.sessions[id_a].media.user_audio  # the VAD-facing queue
        out["mic_frames"] = mic.received
        samples = np.concatenate([(await mic.get()).samples for _ in range(len(mic))])
        out["mic_rms"] = float(np.sqrt(np.mean(samples.astype(np.float64) ** 2)))
        await a.close()
        await b.close()
        await until(lambda: not server.sessions and not factory.sessions, 10, poll_s=0.05)
        out["left"] = (dict(server.sessions), dict(factory.sessions))
        await server.stop()
        return out

    async def b_replay(url, token, client):
        body = {"token": token, "sdp": client.pc.localDescription.sdp, "type": "offer"}
        async with aiohttp.ClientSession() as http, http.post(url + "/offer", json=body) as r:
            data = await r.json()
            if r.status != 200:
                raise SignalingError(r.status, data["error"])

    out = asyncio.run(main())
    assert out["not_json"][0] == 400 and "not JSON" in out["not_json"][1]["error"]
    assert out["missing"][0] == 400
    assert out["wrong_token"] == (403, {"error": "unknown session token"})
    assert out["no_key"][0] == 403
    assert out["bad_sdp"][0] == 400 and "offer" in out["bad_sdp"][1]["error"]
    assert out["after_bad_sdp"] == {} and out["factory_calls_after_bad_sdp"] == 0  # released, no pipeline started
    assert out["replay"] == 409
    assert out["b_closed"]
    assert out["a_still_streaming"] >= 18
    assert out["a_bad_messages"] == 6
    assert out["mic_frames"] >= 50 and out["mic_rms"] > 1000  # the mic tone arrived at 48 kHz
    assert out["left"] == ({}, {})


def test_client_records_what_it_received_to_mp4(tmp_path):
    import av

    async def main():
        server = EgressServer(EgressConfig(port=0), quiet_card())
        url = await server.start()
        _, token = server.create_session()
        client = EgressClient(record_path=tmp_path / "session.mp4", keep_images=True)
        await client.connect(url, token)
        await client.wait_for_video(48, timeout=30)
        await client.close()
        await server.stop()
        return client

    client = asyncio.run(main())
    with av.open(str(tmp_path / "session.mp4")) as f:
        frames = [frame.to_ndarray(format="rgb24") for frame in f.decode(video=0)]
    with av.open(str(tmp_path / "session.mp4")) as f:
        audio_s = sum(frame.samples for frame in f.decode(audio=0)) / TIMELINE_RATE
    received = list(client.video)
    assert len(frames) == len(received)
    assert all(np.abs(a.astype(int) - b.image.astype(int)).mean() < 8 for a, b in zip(frames, received, strict=True))
    received_s = sum(len(a.samples) for a in client.audio) / TIMELINE_RATE
    assert abs(audio_s - received_s) < 0.05  # AAC frames: up to 1,024 samples left in the encoder


def test_recorder_holds_audio_that_arrives_before_the_first_video_frame(tmp_path):
    # Run in a child: audio muxed before the video stream exists made libavformat die with SIGFPE.
    script = f"""
import numpy as np
from pathlib import Path
from charstream.pipeline.web.client import Recorder
rec = Recorder(Path({str(tmp_path / 'a.mp4')!r}))
for _ in range(25):  # 0.5 s of 20 ms packets before any video
    rec.audio((np.sin(np.arange(960) / 8) * 8000).astype(np.int16))
for i in range(24):
    rec.video(np.full((64, 64, 3), 10 * i, np.uint8), pts=i * 3750)
    rec.audio(np.zeros(2000, np.int16))
rec.close()
"""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    import av

    with av.open(str(tmp_path / "a.mp4")) as container:
        kinds = sorted(s.type for s in container.streams)
        audio_s = float(container.streams.audio[0].duration * container.streams.audio[0].time_base)
    assert kinds == ["audio", "video"]
    assert audio_s >= 0.5 + 24 * 2000 / 48_000 - 0.05  # the held half second was kept, not dropped


def test_a_slow_session_setup_is_not_the_clients_silence():
    """The peer connected long before the session's stages were ready (model load, graph capture):
    liveness counts from the first ping, so the session is not ended at once; a client that then
    answers nothing is still found gone after ``client_timeout_s``."""
    import anyio
    import structlog

    from charstream.stages.base import StageContext
    from charstream.stages.egress.stage import EgressStage, PeerLink
    from charstream.transport.messages import ControlKind

    async def main():
        link, controls = PeerLink(), []

        async def end_peer(reason: str) -> None:
            pass

        async def send_control(msg) -> None:
            controls.append(msg)

        async def emit(msg) -> None:
            pass

        link.attach(lambda msg: None, end_peer)  # a client that answers no ping
        link.last_heard -= 60.0  # connected a minute before the stages were up
        stage = EgressStage(EgressConfig(client_timeout_s=0.5, ping_interval_s=0.05), link)
        started = time.monotonic()
        await stage.run(StageContext("egress", "s1", emit, send_control, structlog.get_logger()))
        return time.monotonic() - started, link.reason, controls

    elapsed, reason, controls = anyio.run(main)
    assert 0.5 <= elapsed < 2.0, elapsed
    assert reason == "client vanished (no data-channel reply)"
    assert [c.kind for c in controls] == [ControlKind.SHUTDOWN]


def test_a_frames_report_is_checked_whole_before_any_frame_is_used():
    from charstream.stages.egress.timing import MAX_FRAMES_PER_REPORT, BadReport, presented_frames

    assert presented_frames({"type": "frames", "frames": [[3750, 1e12], [7500.0, 1.5e12]]}) == [(3750, 1e12),
                                                                                                 (7500, 1.5e12)]
    for bad in (None, [], [[1, 2]] * (MAX_FRAMES_PER_REPORT + 1), [[1, 2], [1]], [[1, True]], [[1, float("inf")]],
                ["12"], [[1, 2, 3]], {"rtp": 1}):
        with pytest.raises(BadReport):
            presented_frames({"type": "frames", "frames": bad})


def test_track_bench_reads_every_frame_both_ways(tmp_path):
    """``bench egress track`` runs the serving track over frames released with and without their yuv420p
    planes, and the converter that makes them (its figures are the benchmark's, not asserted here)."""
    import json

    from charstream.pipeline.cli import main

    out = tmp_path / "track.json"
    assert main(["bench", "egress", "track", "--frames", "12", "--size", "64", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["benchmark"] == "egress_track" and result["size"] == 64
    assert result["converted"]["n"] == result["rgb"]["n"] == 8 and result["conversion_per_frame_ms"] > 0
