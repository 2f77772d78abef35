"""The model engine for real: a ``charstream engine`` process hosting the model stages of two live
``hosting = "engine"`` sessions (tiny, CPU) over ipc, its refusals of bad requests, and its death
(SIGKILL) ending its session with an error that names it, within 2 s, leaving nothing behind."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import zmq
import zmq.asyncio
from batch_support import assert_same_frames, released_frames, seeded_configs
from engine_support import (
    DETECT_S,
    answering,
    die_with_the_test,
    frames_released,
    launch_engine,
    start_engine,
    stop_engine,
)

from charstream.model.step import StepOptions
from charstream.pipeline.config import PipelineConfig
from charstream.pipeline.runtime.engine_link import (
    EngineError,
    check_engine_endpoint,
    engine_call,
    pack,
    unpack,
)
from charstream.pipeline.session import LiveSession
from charstream.transport.slots import mapped_blocks


def engine_session(endpoint: str, seed: int) -> LiveSession:
    """A live session (the listening agent, no microphone: every chunk a listening chunk) whose
    model stages the engine hosts."""
    config = PipelineConfig(hosting="engine", engine_endpoint=endpoint)
    config.diffusion.seed = seed
    return LiveSession(config, f"s{seed}", peer=False)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """One engine batching up to two sessions (so it hosts at most two)."""
    folder = tmp_path_factory.mktemp("engine")
    endpoint = f"ipc://{folder}/engine.sock"
    proc = start_engine(endpoint, folder / "engine.log", "--batch-sessions", "2")
    try:
        yield endpoint, proc
    finally:
        code = stop_engine(proc)
    assert code == 0, (folder / "engine.log").read_text()[-3000:]


def test_two_sessions_through_one_engine_stream_then_free_their_groups(engine):
    endpoint, proc = engine

    async def main():
        sessions = [engine_session(endpoint, seed) for seed in (1, 2)]
        for s in sessions:
            s.start()
        frames = await asyncio.wait_for(asyncio.gather(*(frames_released(s, 24) for s in sessions)), 90)
        during = await engine_call(endpoint, {"cmd": "status"})
        with pytest.raises(EngineError, match="the engine is full: it hosts 2 of at most 2"):
            await engine_call(endpoint, {"cmd": "host", "session_id": "s3"})
        results = [await s.stop() for s in sessions]
        deadline = time.monotonic() + 10
        while (after := await engine_call(endpoint, {"cmd": "status"}))["hosted"] and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        alone = await released_frames(seeded_configs(1, 1, (1, 2)), 24)  # the same sessions in one process
        return sessions, during, results, after, frames, alone

    sessions, during, results, after, frames, alone = asyncio.run(main())
    assert sorted(during["sessions"]) == ["s1", "s2"] and during["pid"] == proc.pid
    assert all(r is not None and r.ok for r in results), [r and r.error for r in results]
    for session, result in zip(sessions, results, strict=True):
        assert result.processes == {}  # nothing spawned by the front-end: the engine hosts the model stages
        assert "diffusion" not in session.stages and "playout" in session.stages
        assert session.stages["playout"].stats.fresh_frames >= 24
        edges = result.edges  # the engine's report of the group: both ends of every boundary edge
        assert {"sender", "receiver"} <= set(edges["ingest->conditioning"])  # (no microphone: nothing on it)
        assert edges["decode->playout"]["sender"]["sent"] >= edges["decode->playout"]["receiver"]["received"] >= 6
    # The engine's sessions released the frames the same sessions (seeds) release in one process.
    assert_same_frames(frames, alone, at_least=16)
    # Ending the sessions freed their groups; both went through the engine's shared batchers.
    assert after["hosted"] == 0 and after["served"] >= 2, after
    assert after["batchers"]["diffusion"]["served"] >= 12 and after["batchers"]["decode"]["served"] >= 12, after


def test_a_bad_request_gets_an_error_reply_and_the_engine_keeps_serving(engine):
    endpoint, _ = engine
    good = {"session_id": "x", "config": {}, "weights": "packaged", "nodes": ["diffusion"], "inputs": [],
            "outputs": [], "control": "ipc:///tmp/none", "keys": None}

    async def ask(payloads):
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(endpoint)
        replies = []
        try:
            for payload in payloads:
                await sock.send_multipart(payload if isinstance(payload, list) else [payload])
                assert await sock.poll(5000), f"no reply to {payload!r}"
                replies.append(unpack(await sock.recv()))
        finally:
            sock.close()
            ctx.term()
        return replies

    bad = [
        b"\xc1 not msgpack",
        pack([1, 2, 3]),
        [pack({"cmd": "status"}), b"extra"],
        pack({"cmd": "launch"}),
        pack({"cmd": "host", **good, "config": {"diffusion": {"nope": 1}}}),
        pack({"cmd": "host", **good, "config": {"preset": "characters-14b"}}),
        pack({"cmd": "host", **good, "config": {"transport": {"dead_after_s": "soon"}}}),
        pack({"cmd": "host", **good, "nodes": ["playout"]}),
        pack({"cmd": "host", **good, "inputs": [{"src": "conditioning", "dst": "diffusion", "types": [],
                                                 "endpoint": "ipc:///tmp/x", "capacity": 1}],
              "nodes": ["conditioning", "diffusion"]}),
        pack({"cmd": "host", **good, "inputs": [{"src": "conditioning", "dst": "diffusion", "types": [],
                                                 "endpoint": "file:///etc", "capacity": 1}], "nodes": ["diffusion"]}),
        pack({"cmd": "host", **good, "keys": {"server_public": b"short"}}),
    ]
    replies = asyncio.run(ask(bad))
    expected = ["not msgpack", "expected a map", "expected one frame", "unknown command 'launch'",
                "unknown key(s) ['nope']", "serves preset 'tiny', not 'characters-14b'",
                "transport.dead_after_s: expected float, got str 'soon'", "expected distinct names of",
                "must start with inproc://", "must start with ipc:// or tcp://", "keys: expected None or Z85"]
    for reply, words in zip(replies, expected, strict=True):
        assert reply["ok"] is False and words in reply["error"], (words, reply)
    status = asyncio.run(engine_call(endpoint, {"cmd": "status"}))
    assert status["ok"] and status["hosted"] == 0
    # A second engine on the same ipc path would take it over (ZeroMQ unlinks it): it refuses instead.
    second = subprocess.run([sys.executable, "-m", "charstream", "engine", "--bind", endpoint], capture_output=True,
                            text=True, timeout=60, preexec_fn=die_with_the_test)
    assert second.returncode == 1 and f"(pid {status['pid']}) already serves {endpoint}" in second.stderr, second.stderr
    assert asyncio.run(engine_call(endpoint, {"cmd": "status"}))["pid"] == status["pid"]
    # A valid request from a front-end that then says nothing more (it died): hosted, then freed.
    [accepted] = asyncio.run(ask([pack({"cmd": "host", **good})]))
    assert accepted["ok"] and accepted["hosted"] == 1, accepted

    async def freed() -> float:
        started = time.monotonic()
        while (await engine_call(endpoint, {"cmd": "status"}))["hosted"]:
            assert time.monotonic() - started < 10, "the silent front-end's group was not freed"
            await asyncio.sleep(0.1)
        return time.monotonic() - started

    assert asyncio.run(freed()) < 10


def test_a_session_over_tcp_with_curve_hands_the_engine_its_keys(engine):
    endpoint, _ = engine
    config = PipelineConfig(hosting="engine", engine_endpoint=endpoint)
    config.transport.cross_process, config.transport.curve = "tcp", True  # every cross-process edge CURVE-keyed

    async def main():
        session = LiveSession(config, "s-tcp", peer=False)
        session.start()
        frames = await asyncio.wait_for(frames_released(session, 12), 60)
        return frames, await session.stop()

    frames, result = asyncio.run(main())
    assert len(frames) == 12 and result.ok, result.error
    assert result.edges["decode->playout"]["receiver"]["received"] >= 3  # over tcp, through the engine's CURVE server


FRONT_END = """
import asyncio, sys
from charstream.pipeline.config import PipelineConfig
from charstream.pipeline.session import LiveSession
from charstream.transport.supervisor import PR_SET_PDEATHSIG

async def main():
    session = LiveSession(PipelineConfig(hosting="engine", engine_endpoint=sys.argv[1]), "front", peer=False)
    session.start()
    await session.output.frame_at(12)
    print("streaming", flush=True)
    await asyncio.sleep(120)

asyncio.run(main())
"""


def test_a_killed_front_end_has_its_group_torn_down_and_forgotten(engine):
    endpoint, _ = engine
    front = subprocess.Popen([sys.executable, "-c", FRONT_END, endpoint], stdout=subprocess.PIPE, text=True)
    try:
        assert front.stdout.readline().strip() == "streaming"
        status = asyncio.run(engine_call(endpoint, {"cmd": "status"}))
        assert status["sessions"] == ["front"], status
        front.kill()
        killed = time.monotonic()

        async def freed() -> float:
            while (await engine_call(endpoint, {"cmd": "status"}))["hosted"]:
                assert time.monotonic() - killed < 10, "the dead front-end's group was not freed"
                await asyncio.sleep(0.05)
            return time.monotonic() - killed

        # its hub, its edges and its link fall silent for dead_after_s (1.5 s); then the teardown
        assert asyncio.run(freed()) < 4.0
    finally:
        front.kill()
        front.wait()


def test_a_killed_engine_ends_its_session_naming_it_within_2_s_and_leaves_nothing(tmp_path):
    endpoint = f"ipc://{tmp_path}/engine.sock"
    proc = start_engine(endpoint, tmp_path / "engine.log")
    try:
        async def main():
            session = engine_session(endpoint, 3)
            session.start()
            await asyncio.wait_for(frames_released(session, 12), 90)
            # Each side maps its own senders' slot blocks and the other side's (decode->playout's is the engine's).
            blocks = mapped_blocks(), mapped_blocks(proc.pid)
            os.kill(proc.pid, signal.SIGKILL)
            hit = time.monotonic()
            result = await asyncio.wait_for(session.runner.wait_ending(), 10)
            ended_after = time.monotonic() - hit
            await asyncio.wait_for(session.done.wait(), 10)
            return session, result, ended_after, blocks, mapped_blocks()

        session, result, ended_after, blocks, blocks_left = asyncio.run(main())
    finally:
        stop_engine(proc)
    assert not result.ok and ended_after < DETECT_S, (ended_after, result)
    assert f"the engine at {endpoint}" in result.error and str(proc.pid) in result.error, result.error
    assert session.result.processes == {} and not psutil.pid_exists(proc.pid)  # the front-end spawned nothing
    assert not [p for p in psutil.Process().children(recursive=True) if str(tmp_path) in " ".join(p.cmdline())]
    # The front-end unmapped the dead engine's block (its memory's last reference) and its own.
    assert min(blocks) >= 1 and blocks_left == 0, (blocks, blocks_left)


def test_serve_engine_places_sessions_in_the_engine_and_makes_no_batchers_of_its_own():
    from charstream.pipeline import serve
    from charstream.pipeline.session import session_factory

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    config = serve.load_config(parser.parse_args(["--engine", "ipc:///tmp/e.sock"]))
    assert config.hosting == "engine" and config.engine_endpoint == "ipc:///tmp/e.sock"
    config.diffusion.batch_sessions = config.decode.batch_sessions = 4  # the engine's own setting applies
    factory = session_factory(config)
    assert factory.batcher is None and factory.decode_batcher is None
    with pytest.raises(ValueError, match="the engine's own --gpus and --batch-sessions"):
        serve.load_config(parser.parse_args(["--engine", "ipc:///tmp/e.sock", "--batch-sessions", "8"]))
    with pytest.raises(ValueError, match="loopback only"):
        check_engine_endpoint("tcp://0.0.0.0:5000")


def test_the_engine_decides_the_devices_and_graphs_of_what_it_hosts():
    """A hosted session's model stages run on the engine's devices, graphed as the engine says, whatever
    the session's own config asked for; its other settings stay its own."""
    from charstream.pipeline.runtime.engine import RequestError, engine_session_config

    engine = PipelineConfig(preset="tiny")
    engine.conditioning.device = engine.diffusion.device = engine.decode.device = "cuda:0"
    engine.conditioning.graphed = engine.decode.graphed = False
    engine.diffusion.step = StepOptions(graphed=False, attention="ring")
    session = PipelineConfig(preset="tiny")
    session.conditioning.idle_lead_chunks = 2
    hosted = engine_session_config(engine, session, "packaged", "packaged")
    assert hosted.hosting == "engine" and hosted.conditioning.idle_lead_chunks == 2
    assert {hosted.conditioning.device, hosted.diffusion.device, hosted.decode.device} == {"cuda:0"}
    assert not (hosted.conditioning.graphed or hosted.decode.graphed or hosted.diffusion.step.graphed)
    assert hosted.diffusion.step.attention == "ring"
    with pytest.raises(RequestError, match="serves preset 'tiny'"):
        engine_session_config(engine, PipelineConfig(preset="characters-14b"), None, "packaged")


def _other(value: object) -> object:
    """A value of ``value``'s kind that differs from it."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):  # halved, not raised: a window or wait stays within its field's bounds
        return value / 2 if value else 0.5
    if isinstance(value, str):
        return value + "-other"
    if isinstance(value, list):
        return [*value, "other"]
    if value is None:
        return 7
    if isinstance(value, StepOptions):
        return StepOptions(fused=False, graphed=not value.graphed, attention="ring")
    raise AssertionError(f"no other value for {value!r}: teach _other this field's type")


def test_every_model_section_field_is_the_engines_or_named_the_sessions_own():
    """Each field of the hosted sections differs between engine and session: the hosted config holds the
    engine's, except the fields ``SESSION_OWN_FIELDS`` names -- so a new field cannot be dropped."""
    from charstream.pipeline.runtime.engine import SESSION_OWN_FIELDS, engine_session_config

    engine, session = PipelineConfig(preset="tiny"), PipelineConfig(preset="tiny")
    for name in SESSION_OWN_FIELDS:
        section = getattr(session, name)
        for f in dataclasses.fields(section):
            setattr(section, f.name, _other(getattr(section, f.name)))
    hosted = engine_session_config(engine, session, "packaged", "packaged")
    for name, own in SESSION_OWN_FIELDS.items():
        for f in dataclasses.fields(getattr(hosted, name)):
            source = session if f.name in own else engine
            assert getattr(getattr(hosted, name), f.name) == getattr(getattr(source, name), f.name), f"{name}.{f.name}"
    assert set(SESSION_OWN_FIELDS) >= {"conditioning", "diffusion", "decode"}


def test_an_engine_serves_its_hosted_sessions_step_times_for_prometheus_and_forgets_an_ended_one(tmp_path):
    """``charstream engine --metrics-port``: the step times its hosted stages record (their playout, in
    the front-end, records the rest), its process metrics; a session it no longer hosts has no series."""
    import urllib.request

    from charstream.pipeline.bench.output import free_port

    port = free_port()
    endpoint = f"ipc://{tmp_path}/engine.sock"
    proc = start_engine(endpoint, tmp_path / "engine.log", "--metrics-port", str(port))

    def scrape() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            return reply.read().decode()

    def steps_of(text: str, session: str) -> float | None:
        for line in text.splitlines():
            if line.startswith(f'charstream_step_seconds_count{{session="{session}"}}'):
                return float(line.split()[-1])
        return None

    async def main():
        session = engine_session(endpoint, 5)
        session.start()
        await asyncio.wait_for(frames_released(session, 12), 90)
        during = scrape()
        result = await session.stop()
        deadline = time.monotonic() + 10
        while (await engine_call(endpoint, {"cmd": "status"}))["hosted"] and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        return during, scrape(), result

    try:
        during, after, result = asyncio.run(main())
    finally:
        code = stop_engine(proc)
    assert result is not None and result.ok, result and result.error
    assert (steps_of(during, "s5") or 0) >= 3, during[-2000:]
    assert "process_cpu_seconds_total" in during
    assert steps_of(after, "s5") is None and 'session="s5"' not in after
    assert code == 0, (tmp_path / "engine.log").read_text()[-3000:]


def test_a_session_of_an_engine_restarted_at_its_endpoint_ends_and_a_new_session_runs_there(tmp_path):
    """An engine killed and started again at the same endpoint before the session's liveness rule
    fires (a long ``dead_after_s``): its link reaches the new engine, which does not adopt the old
    session -- the session ends saying so -- and the new engine hosts a new session."""
    endpoint = f"ipc://{tmp_path}/engine.sock"
    first = start_engine(endpoint, tmp_path / "engine-1.log")
    second = None

    def long_lived(seed: int) -> LiveSession:
        session = engine_session(endpoint, seed)
        session.config.transport.dead_after_s = 60.0  # the restart must be what ends it
        return session

    try:
        async def main():
            nonlocal second
            old = long_lived(6)
            old.start()
            await asyncio.wait_for(frames_released(old, 12), 90)
            os.kill(first.pid, signal.SIGKILL)
            first.wait()
            second = launch_engine(endpoint, tmp_path / "engine-2.log")  # from the main thread, which outlives it
            await answering(endpoint, second, tmp_path / "engine-2.log")
            result = await asyncio.wait_for(old.runner.wait_ending(), 20)
            await asyncio.wait_for(old.done.wait(), 10)
            new = engine_session(endpoint, 7)
            new.start()
            await asyncio.wait_for(frames_released(new, 12), 90)
            return result, await new.stop()

        result, fresh = asyncio.run(main())
    finally:
        codes = [stop_engine(p) for p in (first, second) if p is not None]
    assert not result.ok and "hosts no session for this link" in result.error, result.error
    assert str(second.pid) in result.error, result.error
    assert fresh is not None and fresh.ok, fresh and fresh.error
    assert codes[-1] == 0, (tmp_path / "engine-2.log").read_text()[-3000:]
