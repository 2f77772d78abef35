"""Faults for real: the diffusion or decode process of a served ``hosting = "processes"`` session
killed (SIGKILL) or frozen (SIGSTOP) while the page watches, beside a session that must keep
streaming (the page and the log say which stage and why within 2 s; nothing is left behind); the
demo's diffusion process killed (the demo exits at once); an external agent process killed or
frozen mid-turn (its turn ends within 2 s and the next agent is heard)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time

import anyio
import psutil
import pytest
from ingest_support import Recorder
from test_ingest_external import _cut_off, _ended, _run_until
from test_ingest_external import _stage as _agent_stage
from waiting import until

from charstream.pipeline.config import PipelineConfig
from charstream.pipeline.session import session_factory
from charstream.pipeline.web.client import EgressClient
from charstream.pipeline.web.server import EgressServer
from charstream.stages.config import EgressConfig
from charstream.transport.slots import mapped_blocks

DETECT_S = 2.0


def running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("fault, group, stage", [("SIGKILL", "diffusion", "diffusion"), ("SIGSTOP", "decoder", "decode")])
def test_a_killed_or_frozen_model_process_ends_its_session_clearly_and_others_keep_streaming(fault, group, stage, capfd):
    config = PipelineConfig(hosting="processes")
    config.ingest.adapter = "scripted"  # an agent that talks without a microphone: speech flows through the model
    pipeline = session_factory(config)
    card = session_factory(PipelineConfig(), testcard=True)
    bystanders: set[str] = set()

    async def factory(session_id: str):
        return await (card if session_id in bystanders else pipeline)(session_id)

    async def main():
        server = EgressServer(EgressConfig(port=0), factory)
        url = await server.start()
        bystander_id, bystander_token = server.create_session()
        bystanders.add(bystander_id)
        bystander = EgressClient()
        await bystander.connect(url, bystander_token)
        victim_id, victim_token = server.create_session()
        victim = EgressClient()
        await victim.connect(url, victim_token)
        await victim.wait_for_video(12, timeout=120)  # the model processes are up and streaming
        live = pipeline.sessions[victim_id]
        pids = dict(live.runner.pids)
        children = [psutil.Process(pid) for pid in pids.values()]
        blocks = sum(mapped_blocks(pid) for pid in pids.values())  # the session processes' slots
        victim_process = psutil.Process(pids[group])
        os.kill(pids[group], getattr(signal, fault))
        hit = time.monotonic()
        told_after = exited_after = None
        while time.monotonic() - hit < 10 and (told_after is None or exited_after is None):
            if told_after is None and victim.ended is not None:
                told_after = time.monotonic() - hit
            if exited_after is None and not running(victim_process):
                exited_after = time.monotonic() - hit
            await asyncio.sleep(0.01)
        told, exited = told_after is not None, exited_after is not None
        released = await until(lambda: victim_id not in server.sessions and victim_id not in pipeline.sessions, 10)
        others_exited = await until(lambda: not any(running(c) for c in children), 5)
        frames = bystander.video_frames
        await asyncio.sleep(1.0)
        out = {
            "told": told, "told_after": told_after, "ended": victim.ended, "released": released,
            "exited": exited, "exited_after": exited_after, "others_exited": others_exited, "bystander_frames_after": bystander.video_frames - frames,
            "bystander_alive": bystander_id in server.sessions, "blocks": blocks,
            "blocks_left": mapped_blocks(),  # the server received video from the dead session's slots
            "orphans": [p.pid for p in psutil.Process().children(recursive=True) if p.pid in pids.values()],
        }
        # The server still takes new sessions.
        next_id, next_token = server.create_session()
        bystanders.add(next_id)
        newcomer = EgressClient()
        await newcomer.connect(url, next_token)
        await newcomer.wait_for_video(6, timeout=30)
        for client in (victim, bystander, newcomer):
            await client.close()
        await server.stop()
        return out

    out = asyncio.run(main())
    errors = [json.loads(line) for line in capfd.readouterr().err.splitlines()
              if line.startswith("{") and '"session_ending"' in line and '"error"' in line]
    expected = "killed by signal SIGKILL" if fault == "SIGKILL" else "stopped answering heartbeats"
    assert out["told"] and out["told_after"] < DETECT_S, out
    assert f"stage '{stage}'" in out["ended"] and expected in out["ended"], out["ended"]  # on the page
    assert any(expected in (e.get("error") or "") for e in errors), errors  # and in the log
    assert out["exited"] and out["exited_after"] < DETECT_S, out  # a frozen process is killed, too
    assert out["released"] and out["others_exited"] and out["orphans"] == [], out
    assert out["blocks"] >= 1 and out["blocks_left"] == 0, out  # with its processes gone, its slots are freed
    assert out["bystander_alive"] and out["bystander_frames_after"] >= 18, out  # 24 fps went on


def test_the_demo_exits_soon_after_a_stage_death(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "charstream", "demo", "--hosting", "processes", "--turns", "2",
                             "--out", str(tmp_path), "--verbose"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        pids = None
        for line in proc.stderr:  # the JSON log: the stage processes' pids once the session started
            if '"session_started"' in line:
                pids = json.loads(line)["pids"]
                break
        assert pids, "the demo's session never started"
        threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep the pipe drained
        time.sleep(2.0)  # streaming
        os.kill(pids["diffusion"], signal.SIGKILL)
        hit = time.monotonic()
        out, _ = proc.communicate(timeout=60)
        took = time.monotonic() - hit
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1 and "the session failed: stage 'diffusion'" in out and "killed by signal SIGKILL" in out
    assert "had not caught up" not in out  # it did not wait out the client's catch-up time (15 s)
    assert took < 10, f"the demo exited {took:.1f} s after its diffusion process died"


@pytest.mark.parametrize("fault", ["SIGKILL", "SIGSTOP"])
def test_an_agent_killed_or_frozen_mid_turn_ends_its_turn_and_the_character_listens_again(fault):
    stage, rec = _agent_stage(), Recorder()  # the default zmq_dead_after_s: a frozen agent is found by silence
    procs, timing = [], {}

    async def clients(stage):
        timing["ended_after"] = await _cut_off(stage, rec, procs, getattr(signal, fault))

    try:
        anyio.run(_run_until, stage, rec, lambda: _ended(rec, 2), clients)
        procs[1].communicate(timeout=10)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()  # the frozen agent (SIGKILL ends a stopped process too)
            proc.wait(timeout=5)
    assert timing["ended_after"] < DETECT_S, timing
    errors = [e for e in rec.log_events("error") if "mid-turn" in e.get("problem", "")]
    assert len(errors) == 1 and errors[0]["turn_id"] == 1, rec.log_events("error")
    assert len(rec.audio(2)) > 0  # back to listening: the next agent's turn was heard
