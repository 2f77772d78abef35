"""``charstream bench capacity`` end to end on CPU: two live sessions on two server processes, their
aiortc clients in a process of their own, a measured window, and every process gone afterwards."""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from charstream.pipeline.bench import capacity as bench_capacity

PORTRAIT = Path(__file__).parents[1] / "examples" / "portrait.png"


def test_bench_capacity_measures_frames_the_clients_received(tmp_path):
    out = tmp_path / "capacity.json"
    done = subprocess.run([sys.executable, "-m", "charstream", "bench", "capacity", "--sessions", "2", "--workers", "2",
                           "--clients", "1", "--warmup", "1", "--hold", "4", "--start-timeout", "60", "--spread-s", "3",
                           "--client-nice", "7", "--out", str(out)], capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    [ladder] = report["ladders"]
    assert "error" not in ladder and not report["partial"]
    [level] = ladder["levels"]
    sessions = level["per_session"]
    assert level["sessions"] == 2 and {s["worker"] for s in sessions} == {"worker-0", "worker-1"}
    window = level["window_s"]
    for s in sessions:
        assert "problem" not in s, s
        assert s["received_fps"] * window >= 24, s  # at least a second of video decoded by the client in the window
        # The client cannot get frames playout never released (its snapshot is a moment after the worker's).
        assert 0 < s["frames_received_total"] <= s["frames_released_total"] + 12, s
        assert s["held"] == (min(s["playout_fps"], s["received_fps"]) >= 24 - 1 / window and s["ended"] is None)
        assert sum(s[k] for k in bench_capacity.CAUSE_KEYS) == s["underruns"], s  # every underrun has its cause
    assert level["below"] == sum(not s["held"] for s in sessions)
    # --spread-s 3: the second of two sessions connected 1.5 s after the first (connecting takes ~0.1-0.5 s).
    assert 1.0 <= level["connects_span_s"] <= 3.0 and report["spread_s"] == 3, level["connects_span_s"]
    assert all(level[k] == sum(s[k] for s in sessions) for k in bench_capacity.CAUSE_KEYS)
    assert {p["name"] for p in level["processes"]} == {"worker-0", "worker-1", "client-0"}
    # the client process runs below the servers (their niceness is this test's own: 0 on CI)
    assert ladder["clients_nice"] == {"client-0": min(19, psutil.Process().nice() + 7)} and report["client_nice"] == 7
    assert 0 <= level["host_cpu_steal"] <= level["host_cpu_busy"] <= 1  # steal counts busy: the VM's cores taken
    assert all(p["cores"] > 0 and p["loop_lag"]["samples"] > 0 for p in level["processes"] if p["sessions"])
    for p in level["processes"]:  # a server's cores by thread: its event loop's among them, none past the total
        if p["name"].startswith("worker"):
            assert "MainThread" in p["threads_cores"] and sum(p["threads_cores"].values()) <= p["cores"] + 0.05, p
    # Clean shutdown: every worker and client exited by itself, none is left.
    assert all(e["exit"] == "exited with status 0" for e in ladder["process_exits"].values()), ladder["process_exits"]
    assert not any(psutil.pid_exists(pid) for pid in ladder["pids"].values())
    assert "1 client processes (nice 7)" in done.stdout
    assert "capacity: tiny sessions, CPU" in done.stdout and "sessions started over 3 s" in done.stdout and report["agent_pace"] == "realtime"
    assert report["host_loop_ms"] > 0 and f"a core's Python loop {report['host_loop_ms']:g} ms" in done.stdout


def test_bench_capacity_serves_a_flashhead_session_to_its_client(tmp_path):
    """A FlashHead session (Lite, 1 block, 32 x 32: slower than real time on 2 cores, so not held) through
    the whole bench: its portrait, its 25 fps as the rate to hold, its chunk steps through the process's
    batchers (a batch of one), video at the client."""
    out = tmp_path / "capacity.json"
    done = subprocess.run([sys.executable, "-m", "charstream", "bench", "capacity", "--preset", "flashhead-lite",
                           "--weights", "random", "--portrait", str(PORTRAIT), "--blocks", "1", "--size",
                           "32", "--vae-width", "0.25", "--sessions", "1", "--workers", "1", "--clients", "1", "--threads", "2",
                           "--batch-sessions", "2", "--warmup", "2", "--hold", "4", "--start-timeout", "90",
                           "--out", str(out)],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert (report["preset"], report["blocks"], report["size"], report["min_fps"]) == ("flashhead-lite", 1, 32, 25.0)
    [level] = report["ladders"][0]["levels"]
    [session] = level["per_session"]
    assert "problem" not in session and session["ended"] is None, session
    assert session["received_fps"] * level["window_s"] >= 25, session  # a second of video decoded by the client
    assert level["step_ms"]["steps"] >= 1 and level["step_ms"]["p50"] > 0  # chunks denoised in the window
    # --batch-sessions 2: its encodes, chunks and decodes went through the process's batchers
    [server] = [p for p in level["processes"] if p["name"] == "worker-0"]
    assert set(server["batched"]) == {"diffusion", "decode", "encode"}, server
    assert all(b["forwards"] >= 1 and b["served"] == b["forwards"] for b in server["batched"].values()), server
    assert "capacity: flashhead-lite sessions, CPU" in done.stdout


def test_a_flashhead_capacity_run_needs_its_portrait_and_a_sessions_model_stages_in_one_process():
    from charstream.pipeline.cli import main

    with pytest.raises(SystemExit, match="needs --portrait IMAGE"):
        main(["bench", "capacity", "--preset", "flashhead-lite", "--weights", "random"])
    with pytest.raises(SystemExit, match=r"in one process \(hosting inproc or engine\)"):
        main(["bench", "capacity", "--preset", "flashhead-lite", "--weights", "random", "--portrait", str(PORTRAIT),
              "--hosting", "processes"])
    with pytest.raises(SystemExit, match="resize a FlashHead model"):
        main(["bench", "capacity", "--blocks", "1"])


def test_batch_sessions_sets_both_batchers_and_the_scripted_agent_needs_no_recogniser():
    args = argparse.Namespace(preset="tiny", gpus=None, hosting="inproc", threads=1, sessions=[1], start_timeout=10,
                              warmup=1, hold=1, recognizer=False, agent_pace="synthesized")
    config = bench_capacity.session_config(args, 4)
    assert config.diffusion.batch_sessions == config.decode.batch_sessions == config.conditioning.batch_sessions == 4
    assert config.ingest.adapter == "scripted" and not config.ingest.scripted_recognizer
    assert config.ingest.agent_pace == "synthesized"
    with pytest.raises(ValueError, match="must be >= 1"):
        bench_capacity.session_config(args, 0)


def test_engines_place_every_session_in_an_engine_and_size_each_engine():
    args = argparse.Namespace(preset="tiny", gpus=None, hosting=None, engines=2, threads=1, sessions=[8, 16],
                              workers=4, start_timeout=10, warmup=1, hold=1, recognizer=False,
                              agent_pace="realtime")
    assert bench_capacity.session_config(args, 8).hosting == "engine"
    assert bench_capacity.per_process(args) == 8  # 16 sessions over 2 engines
    assert [bench_capacity.engine_of(w, 2) for w in range(4)] == ["engine-0", "engine-1", "engine-0", "engine-1"]
    args.hosting = "inproc"
    with pytest.raises(ValueError, match="hosting engine and --engines"):
        bench_capacity.session_config(args, 1)


def test_a_starved_event_loop_names_the_busiest_threads_of_its_process():
    process = {"name": "worker-0", "main_thread": 0.8, "cores": 2.8, "loop_lag": {"p99_ms": 117.0},
               "threads_cores": {"chunk-denoise-batcher": 0.9, "MainThread": 0.8, "native": 0.6, "egress": 0.3,
                                 "decode": 0.1}}
    [sentence] = bench_capacity.saturated({"gpu": None, "host_cpu_busy": 0.2, "host_cpu_steal": 0.0,
                                           "host_cores": 16, "processes": [process]})
    assert "starved (of a core or the GIL)" in sentence
    assert sentence.endswith("(busiest threads, cores: chunk-denoise-batcher 0.90, MainThread 0.80, native 0.60, "
                             "egress 0.30)")


def test_a_processs_cpu_is_told_by_thread_name_a_pools_threads_together():
    import threading
    import time

    from charstream.pipeline.bench.capacity_worker import thread_cpu

    def spin(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    spun, release = threading.Barrier(3), threading.Event()

    def spinner() -> None:
        spin(0.2)
        spun.wait()
        release.wait()  # alive until read: an ended thread leaves /proc, its CPU with it

    before = thread_cpu()
    spinners = [threading.Thread(target=spinner, name=f"spinner_{i}") for i in range(2)]
    for t in spinners:
        t.start()
    spin(0.1)  # the main thread's own
    spun.wait()
    after = thread_cpu()
    release.set()
    for t in spinners:
        t.join()
    assert after["spinner"] >= 0.38  # both pool threads' 0.2 s, as one name (10 ms clock ticks)
    assert after["MainThread"] - before["MainThread"] >= 0.08
    cores = bench_capacity.thread_cores(before, after, 1.0)
    assert list(cores)[0] == "spinner" and all(v >= 0.01 for v in cores.values())


def test_a_window_whose_cores_the_hypervisor_took_says_so():
    level = {"gpu": None, "host_cpu_busy": 0.7, "host_cpu_steal": 0.12, "host_cores": 16, "processes": []}
    assert bench_capacity.saturated(level) == [
        "the VM's cores ran something else 12% of the time (steal): what every process here did not get"]
    assert bench_capacity.saturated({**level, "host_cpu_steal": 0.01}) == []


@pytest.mark.parametrize("nice", ["-1", "20"])
def test_a_client_niceness_out_of_range_is_refused_before_anything_starts(nice):
    from charstream.pipeline.cli import main

    before = set(psutil.Process().children(recursive=True))
    with pytest.raises(SystemExit, match=f"--client-nice must be 0-19, got {nice}"):
        main(["bench", "capacity", "--client-nice", nice])
    assert set(psutil.Process().children(recursive=True)) == before  # nothing was started


def test_a_clients_received_frames_are_counted_past_its_kept_window():
    """A session older than the client's kept window (60 s of frames) still reports every frame it
    received: a ladder's earlier sessions read 13.5 fps at its next count when the kept window was counted."""
    from charstream.pipeline.bench.capacity_worker import Clients
    from charstream.pipeline.web.client import EgressClient, ReceivedVideo

    async def main():
        clients = Clients(connect_timeout_s=5)
        client = clients.clients["s"] = EgressClient(kept_s=1.0)
        for i in range(100):
            client.video.append(ReceivedVideo(float(i), i * 3750, None))
            client.video_frames += 1
        return len(client.video), (await clients.stats({}))["sessions"]["s"]["video_frames"]

    kept, counted = asyncio.run(main())
    assert kept == 24 and counted == 100
