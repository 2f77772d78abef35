"""The external agent over a real ZeroMQ socket: the example client, spawned as its own process,
drives an ingest session; barge-in reaches it as an ``interrupt``; a killed agent ends its turn and a
new one takes over; malformed messages are answered with an error and logged with the turn id."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import anyio
import msgpack
import numpy as np
import pytest
import zmq
import zmq.asyncio
from charstream.stages.config import IngestConfig
from charstream.stages.ingest.external import ExternalAgent
from charstream.stages.ingest.resample import resample, to_int16
from charstream.stages.ingest.stage import IngestStage
from charstream.stages.ingest.tts import synthesize
from charstream.transport.messages import TurnKind
from ingest_support import Recorder

from charstream.timeline import TIMELINE_RATE

ROOT = Path(__file__).resolve().parents[1]
CLIENT = ROOT / "examples" / "external_agent.py"


def _spawn(endpoint: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(CLIENT), "--endpoint", endpoint, *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _ended(rec, n):
    return sum(e.kind == TurnKind.AGENT_TURN_END for e in rec.turn_events()) >= n


async def _run_until(stage, rec, done, also=None, timeout=60.0):  # a hang guard, not a speed test
    """Run the ingest stage (and ``also``) until ``done()``; then stop everything."""
    ctx = rec.context()
    await stage.setup(ctx)
    try:
        with anyio.fail_after(timeout):
            async with anyio.create_task_group() as tg:
                tg.start_soon(stage.run, ctx)
                if also is not None:
                    tg.start_soon(also, stage)
                while not done():
                    await anyio.sleep(0.05)
                tg.cancel_scope.cancel()
    finally:
        await stage.teardown()


def _stage(**overrides):
    config = IngestConfig(adapter="zmq", zmq_endpoint="tcp://127.0.0.1:0", **overrides)
    return IngestStage(config, ExternalAgent(config))


def test_example_agent_drives_an_ingest_session_over_a_real_socket():
    stage, rec = _stage(), Recorder()
    lines = ["Hello from another process.", "This is my second turn."]
    procs = []

    async def client(stage):
        procs.append(_spawn(stage.adapter.bound_endpoint, "--line", lines[0], "--line", lines[1],
                            "--rate", "16000", "--pause", "0.2"))

    anyio.run(_run_until, stage, rec, lambda: _ended(rec, 2), client)
    out, err = procs[0].communicate(timeout=10)
    assert procs[0].returncode == 0, err
    for turn_id, text in ((1, lines[0]), (2, lines[1])):
        audio = rec.audio(turn_id)
        speech = synthesize(text, "en+f3")
        sent = len(resample(speech.samples.astype(np.float32), speech.sample_rate, 16_000))
        # every 16 kHz sample the agent sent arrives once, resampled to the 48 kHz timeline
        assert sum(len(a.samples) for a in audio) == sent * 3
        assert "agent_first_audio" in audio[0].trace.stamps
    assert stage.stats.protocol_errors == 0


def test_barge_in_interrupts_the_external_agent():
    stage, rec = _stage(), Recorder()
    procs = []
    long_line = "I am going to keep talking for quite a while about many things, unless somebody stops me."
    user = synthesize("Sorry, can I stop you there?", "en-us")
    mic = to_int16(resample(user.samples.astype(np.float32) / 32768.0, user.sample_rate, 48_000))

    async def client_and_user(stage):
        procs.append(_spawn(stage.adapter.bound_endpoint, "--line", long_line, "--pause", "0.1"))
        while not rec.audio(1) or sum(len(a.samples) for a in rec.audio(1)) < TIMELINE_RATE:
            await anyio.sleep(0.02)  # the character has been speaking for 1 s: the user talks over it
        start = anyio.current_time()
        for i in range(0, len(mic) + 48_000, 960):
            frame = np.zeros(960, np.int16)
            frame[:len(mic[i:i + 960])] = mic[i:i + 960]
            await stage.feed_user_audio(frame, stage.media_t0 + stage.media_now() / TIMELINE_RATE)
            await anyio.sleep(max(0.0, start + (i + 960) / 48_000 - anyio.current_time()))

    anyio.run(_run_until, stage, rec, lambda: _ended(rec, 1), client_and_user)
    out, _ = procs[0].communicate(timeout=10)
    assert stage.stats.interrupts == 1
    assert '"type": "interrupt"' in out and '"reason": "interrupted"' in out
    end = [e for e in rec.turn_events() if e.kind == TurnKind.AGENT_TURN_END][0]
    assert end.turn_id == 1
    spoken = sum(len(a.samples) for a in rec.audio(1)) / TIMELINE_RATE
    assert spoken < synthesize(long_line, "en+f3").duration - 1.0  # cut short
    assert '"type": "user_speech_start"' in out  # the agent hears what the VAD heard


def test_killed_agent_ends_its_turn_and_a_new_agent_takes_over():
    stage, rec = _stage(zmq_dead_after_s=0.5), Recorder()
    procs = []

    async def clients(stage):
        endpoint = stage.adapter.bound_endpoint
        procs.append(_spawn(endpoint, "--line", "I will be cut off in the middle of this long sentence.",
                            "--pause", "0.1"))
        while not rec.audio(1):
            await anyio.sleep(0.02)
        os.kill(procs[0].pid, signal.SIGKILL)  # mid-turn
        while not _ended(rec, 1):
            await anyio.sleep(0.02)
        procs.append(_spawn(endpoint, "--line", "I am the new agent.", "--pause", "0.1"))

    anyio.run(_run_until, stage, rec, lambda: _ended(rec, 2), clients)
    procs[0].wait(timeout=5)
    procs[1].communicate(timeout=10)
    errors = [e for e in rec.log_events("error") if "disconnected mid-turn" in e.get("problem", "")]
    assert len(errors) == 1 and errors[0]["turn_id"] == 1
    assert len(rec.audio(2)) > 0  # the session kept streaming and the next agent was heard


@pytest.mark.parametrize("frames,problem", [
    ([b"\xc1\xc1garbage"], "not msgpack"),
    ([msgpack.packb({"v": 7, "type": "hello"})], "protocol version 7"),
    ([msgpack.packb({"v": 1, "type": "audio", "turn": 5, "rate": 12_345, "format": "s16le"}), b"\0\0" * 100],
     "unsupported sample rate 12345"),
    ([msgpack.packb({"v": 1, "type": "audio", "turn": 5, "rate": 16_000, "format": "mulaw"}), b"\0" * 100],
     "unsupported audio format 'mulaw'"),
    ([msgpack.packb({"v": 1, "type": "audio", "turn": 5, "rate": 16_000, "format": "s16le"}), b"\0" * 101],
     "not a whole number"),
])
def test_malformed_messages_get_an_error_reply_and_are_logged(frames, problem):
    stage, rec = _stage(), Recorder()
    replies = []

    async def raw_agent(stage):
        socket = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        socket.connect(stage.adapter.bound_endpoint)
        try:
            await socket.send_multipart([msgpack.packb({"v": 1, "type": "hello", "agent": "raw"})])
            replies.append(msgpack.unpackb((await socket.recv_multipart())[0]))
            await socket.send_multipart([msgpack.packb({"v": 1, "type": "turn_start", "turn": 5})])
            await socket.send_multipart(frames)
            replies.append(msgpack.unpackb((await socket.recv_multipart())[0]))
            # the channel still works after the bad message
            tone = (np.sin(np.arange(1600) * 0.1) * 8000).astype("<i2").tobytes()
            await socket.send_multipart([msgpack.packb({"v": 1, "type": "audio", "turn": 5, "rate": 16_000,
                                                        "format": "s16le"}), tone])
            await socket.send_multipart([msgpack.packb({"v": 1, "type": "turn_end", "turn": 5})])
            await anyio.sleep(1.0)
        finally:
            socket.close(linger=0)

    anyio.run(_run_until, stage, rec, lambda: _ended(rec, 1), raw_agent)
    welcome, error = replies
    assert welcome["type"] == "welcome" and welcome["timeline_rate"] == 48_000
    assert error["type"] == "error" and problem in error["detail"]
    [logged] = [e for e in rec.log_events("error") if problem in e.get("problem", "")]
    assert logged["turn_id"] == 1
    assert sum(len(a.samples) for a in rec.audio(1)) == 1600 * 3
