"""The external agent over a real ZeroMQ socket: the example client, spawned as its own process,
drives an ingest session; barge-in reaches it as an ``interrupt``; a killed agent ends its turn and a
new one takes over; malformed messages are answered with an error and logged with the turn id."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import msgpack
import numpy as np
import pytest
import zmq
import zmq.asyncio
from ingest_support import Recorder

from charstream.stages.agents.tts import synthesize
from charstream.stages.config import IngestConfig
from charstream.stages.ingest.external import ExternalAgent
from charstream.stages.ingest.resample import resample, to_int16
from charstream.stages.ingest.stage import IngestStage
from charstream.timeline import TIMELINE_RATE
from charstream.transport.messages import TurnKind

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


async def _cut_off(stage, rec, procs: list[subprocess.Popen], fault: signal.Signals) -> float:
    """An agent speaks a long line and gets ``fault`` mid-turn; once its turn has ended a new agent
    speaks (``procs``: both). Returns the seconds from the fault to the end of its turn."""
    endpoint = stage.adapter.bound_endpoint
    procs.append(_spawn(endpoint, "--line", "I will be cut off in the middle of this long sentence.", "--pause", "0.1"))
    while not rec.audio(1):
        await anyio.sleep(0.02)
    os.kill(procs[0].pid, fault)
    hit = time.monotonic()
    while not _ended(rec, 1):
        await anyio.sleep(0.01)
    ended_after = time.monotonic() - hit
    procs.append(_spawn(endpoint, "--line", "I am the new agent.", "--pause", "0.1"))
    return ended_after


def test_killed_agent_ends_its_turn_and_a_new_agent_takes_over():
    stage, rec = _stage(zmq_dead_after_s=0.5), Recorder()
    procs = []

    async def clients(stage):
        await _cut_off(stage, rec, procs, signal.SIGKILL)

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
    # each of these once crashed ingest or was wrongly accepted
    ([msgpack.packb({"v": 1, "type": "audio", "turn": 5, "rate": 16_000, "format": []}), b"\0" * 100],
     "unsupported audio format []"),
    ([msgpack.packb({"v": 1, "type": "audio", "turn": 5, "rate": 16_000, "format": {}}), b"\0" * 100],
     "unsupported audio format {}"),
    ([msgpack.packb({"v": 1, "type": "audio", "turn": 5, "rate": 16_000, "format": "s16le", "channels": True}),
      b"\0" * 100], "'channels' must be integers"),
    ([msgpack.packb({"v": 1, "type": "turn_end", "turn": [5]})], "'turn' must be a string or an integer, got list"),
    ([msgpack.packb({"v": 1, "type": "turn_end", "turn": {"a": 5}})], "'turn' must be a string or an integer, got dict"),
    ([msgpack.packb({"v": True, "type": "turn_end", "turn": 5})], "protocol version True"),
    ([msgpack.packb({"v": 1.0, "type": "turn_end", "turn": 5})], "protocol version 1.0"),
    ([msgpack.packb({"v": 1, "type": "audio", "turn": 5, "rate": 8_000, "format": "s16le"}), b"\0\0" * 8_001],
     "at most 1.0 s per message"),
    ([msgpack.packb({"v": 1, "type": "audio", "turn": 5, "rate": 16_000, "format": "f32le"}),
      np.array([0.1, np.nan, np.inf, 0.2], "<f4").tobytes()], "2 non-finite samples"),
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
    assert stage.stats.protocol_errors == 1  # counted, and nothing else went wrong
    assert sum(len(a.samples) for a in rec.audio(1)) == 1600 * 3


def test_oversized_message_drops_the_sender_and_the_socket_keeps_serving():
    """A 256 MiB frame (once +524 MB of RSS) is cut off by ZeroMQ at MAX_MESSAGE_BYTES before
    it is buffered; the process barely grows and a well-behaved agent is served after it."""
    import psutil

    from charstream.stages.ingest.external import MAX_MESSAGE_BYTES

    stage, rec = _stage(), Recorder()
    rss = []

    async def agents(stage):
        context = zmq.asyncio.Context.instance()
        big = context.socket(zmq.DEALER)
        big.setsockopt(zmq.LINGER, 0)
        big.connect(stage.adapter.bound_endpoint)
        rss.append(psutil.Process().memory_info().rss)
        payload = bytes(64 * MAX_MESSAGE_BYTES)
        await big.send_multipart([msgpack.packb({"v": 1, "type": "hello"}), payload])
        del payload
        await anyio.sleep(1.0)
        rss.append(psutil.Process().memory_info().rss)
        big.close(linger=0)
        good = context.socket(zmq.DEALER)
        good.connect(stage.adapter.bound_endpoint)
        try:
            await good.send_multipart([msgpack.packb({"v": 1, "type": "hello", "agent": "good"})])
            rss.append(msgpack.unpackb((await good.recv_multipart())[0])["type"])
            await good.send_multipart([msgpack.packb({"v": 1, "type": "turn_start", "turn": 1})])
            await good.send_multipart([msgpack.packb({"v": 1, "type": "turn_end", "turn": 1})])
            await anyio.sleep(0.5)
        finally:
            good.close(linger=0)

    anyio.run(_run_until, stage, rec, lambda: _ended(rec, 1), agents)
    before, after, welcome = rss
    assert welcome == "welcome"
    # the sender's own 64 MiB buffer is freed by then; the receiver never held the message
    assert after - before < 32 * MAX_MESSAGE_BYTES, (before, after)


def test_agent_socket_off_loopback_requires_curve():
    config = IngestConfig(adapter="zmq", zmq_endpoint="tcp://0.0.0.0:0")

    async def main():
        agent = ExternalAgent(config)
        with pytest.raises(PermissionError, match="not loopback"):
            await agent.start()

    anyio.run(main)


def test_curve_agent_socket_lets_in_only_known_agents():
    server_public, server_secret = zmq.curve_keypair()
    known_public, known_secret = zmq.curve_keypair()
    stranger_public, stranger_secret = zmq.curve_keypair()
    config = IngestConfig(adapter="zmq", zmq_endpoint="tcp://127.0.0.1:0", zmq_curve_secret_key=server_secret.decode(),
                          zmq_curve_agents=[known_public.decode()])

    async def main():
        agent = ExternalAgent(config)
        await agent.start()
        answers = {}

        async def pump():  # ingest's side: read the socket (answers hellos)
            async for _ in agent.events():
                pass

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(pump)
                for name, (public, secret) in {"stranger": (stranger_public, stranger_secret),
                                               "known": (known_public, known_secret)}.items():
                    socket = zmq.asyncio.Context.instance().socket(zmq.DEALER)
                    socket.curve_serverkey, socket.curve_publickey, socket.curve_secretkey = server_public, public, secret
                    socket.connect(agent.bound_endpoint)
                    await socket.send_multipart([msgpack.packb({"v": 1, "type": "hello", "agent": name})])
                    with anyio.move_on_after(1.0):
                        answers[name] = msgpack.unpackb((await socket.recv_multipart())[0])["type"]
                    socket.close(linger=0)
                tg.cancel_scope.cancel()
        finally:
            await agent.close()
        return answers

    answers = anyio.run(main)
    assert answers == {"known": "welcome"}  # the stranger's hello never arrived


def test_sessions_share_one_agent_endpoint_told_apart_by_token():
    """Two sessions' ExternalAgents on one AgentHub: each agent's hello names its session's token
    (or none: the oldest session still waiting); each session hears only its own agent's turns, an
    unknown token is refused, and every agent's messages reach the right ingest."""
    from charstream.stages.ingest.external import AgentHub

    config = IngestConfig(adapter="zmq", zmq_endpoint="tcp://127.0.0.1:0")

    async def main():
        hub = AgentHub(config)
        await hub.start()
        agents = [ExternalAgent(config, f"s{i}", hub=hub) for i in range(3)]
        seen: dict[str, list] = {a.session_id: [] for a in agents}
        replies = {}
        try:
            for agent in agents:
                await agent.start()

            async def pump(agent):
                async for event in agent.events():
                    seen[agent.session_id].append(event)

            async with anyio.create_task_group() as tg:
                for agent in agents:
                    tg.start_soon(pump, agent)
                context = zmq.asyncio.Context.instance()
                hellos = {"stranger": "not-a-token", "second": agents[1].token, "first": None, "third": None}
                sockets = {}
                for name, token in hellos.items():
                    socket = sockets[name] = context.socket(zmq.DEALER)
                    socket.setsockopt(zmq.LINGER, 0)
                    socket.connect(hub.bound_endpoint)
                    hello = {"v": 1, "type": "hello", "agent": name} | ({"session": token} if token else {})
                    await socket.send_multipart([msgpack.packb(hello)])
                    with anyio.fail_after(5):
                        replies[name] = msgpack.unpackb((await socket.recv_multipart())[0])
                for turn, name in enumerate(("first", "second", "third")):
                    await sockets[name].send_multipart([msgpack.packb({"v": 1, "type": "turn_start", "turn": turn})])
                with anyio.fail_after(5):
                    while sum(len(v) for v in seen.values()) < 3:
                        await anyio.sleep(0.02)
                for socket in sockets.values():
                    socket.close(linger=0)
                tg.cancel_scope.cancel()
        finally:
            for agent in agents:
                await agent.close()
            await hub.close()
        return hub, replies, seen

    hub, replies, seen = anyio.run(main)
    assert replies["stranger"] == {"type": "error", "detail": "unknown session token", "v": 1}
    assert all(replies[n]["type"] == "welcome" for n in ("first", "second", "third"))
    # the tokenless hellos took the sessions still waiting, oldest first; the named one its own
    assert [[e.turn_ref for e in seen[s]] for s in ("s0", "s1", "s2")] == [[0], [1], [2]]
    assert hub.unrouted == 1 and hub.dropped == 0


def test_two_live_sessions_each_hear_their_own_agent_on_one_endpoint():
    """Two full sessions (the tiny model, in-process) share the server's agent socket; two agent
    processes' worth of clients join them by token; each session's ingest gets exactly its own
    agent's speech (different lengths, so a mix-up shows)."""
    import asyncio

    from charstream.pipeline.config import PipelineConfig
    from charstream.pipeline.integrations.agent_client import ExternalAgentClient
    from charstream.pipeline.session import LiveSession
    from charstream.stages.ingest.external import AgentHub

    lines = {"a": "Hello from the first agent.", "b": "And this is the second agent, speaking a little longer."}

    async def main():
        config = PipelineConfig(preset="tiny")
        config.ingest.adapter, config.ingest.zmq_endpoint = "zmq", "tcp://127.0.0.1:0"
        hub = AgentHub(config.ingest)
        await hub.start()
        sessions = {name: LiveSession(config, f"s-{name}", peer=False, agent_hub=hub) for name in lines}
        try:
            for session in sessions.values():
                session.start()
            class Client(ExternalAgentClient):  # keeps what it sent (espeak's length varies by a few samples)
                def pcm(self, text):
                    self.sent = super().pcm(text)
                    return self.sent

            clients = {name: Client(hub.bound_endpoint, rate=24_000, on_event=lambda **_: None,
                                    session=sessions[name].agent_token) for name in lines}
            await asyncio.wait_for(asyncio.gather(*(
                clients[name].run([lines[name]], pause_s=0.1, wait_for_user=False, linger_s=0.5)
                for name in lines)), 60)
            expected = {name: 2 * len(clients[name].sent) for name in lines}  # 24 -> 48 kHz
            stats = {name: s.stages["ingest"].stats for name, s in sessions.items()}
            for _ in range(100):  # the turn end's resampler flush may still be on its way downstream
                if all(stats[name].samples_emitted == expected[name] for name in lines):
                    break
                await asyncio.sleep(0.05)
        finally:
            for session in sessions.values():
                await session.stop("test over")
            await hub.close()
        return stats, expected

    stats, expected = asyncio.run(main())
    for name in lines:
        assert stats[name].turns == 1 and stats[name].protocol_errors == 0
        assert stats[name].samples_emitted == expected[name]  # every sample of its own agent, once
