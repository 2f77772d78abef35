"""The runner and supervisor with real sockets and real spawned processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import anyio
import psutil
import pytest

from charstream.pipeline.config import PipelineConfig
from charstream.pipeline.runtime.runner import Edge, Graph, Node, SessionRunner, plan_groups, run_session
from charstream.transport.config import TransportConfig
from charstream.transport.messages import ControlKind

STAGES = "test_runner_stages"
TESTS_DIR = Path(__file__).parent
REPO = TESTS_DIR.parent


def chain(count: int, groups=("main", "main"), **sink) -> Graph:
    return Graph(
        [
            Node("src", f"{STAGES}:Source", {"count": count}, groups[0]),
            Node("relay", f"{STAGES}:Relay", {}, groups[1]),
            Node("sink", f"{STAGES}:Sink", {"expect": count, **sink}, "main"),
        ],
        [Edge("src", "relay", capacity=3), Edge("relay", "sink", capacity=2)],
    )


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def assert_no_stage_processes(pids):
    assert pids and all(gone(pid) for pid in pids), {p: not gone(p) for p in pids}
    assert not [c for c in psutil.Process().children(recursive=True) if c.pid in pids]


def test_inproc_session_delivers_in_order_and_ends_on_shutdown():
    result = anyio.run(run_session, chain(200), PipelineConfig(hosting="inproc"), "s-inproc")
    assert result.ok and result.ended_by == "shutdown by sink", result.error
    assert result.stages["sink"].chunks == list(range(200))
    assert result.stages["sink"].torn_down
    assert result.edges["relay->sink"]["sender"]["max_in_flight"] <= 2
    assert result.edges["src->relay"]["sender"]["max_in_flight"] <= 3
    assert result.edges["relay->sink"]["receiver"]["received"] == 200 and result.processes == {}


@pytest.mark.parametrize(
    "transport",
    [TransportConfig(), TransportConfig(cross_process="tcp", curve=True)],
    ids=["ipc", "tcp-curve"],
)
def test_session_across_spawned_processes(transport):
    config = PipelineConfig(hosting="processes", transport=transport)
    result = anyio.run(run_session, chain(100, groups=("producer", "middle")), config, "s-procs")
    assert result.ok and result.ended_by == "shutdown by sink", result.error
    assert result.stages["sink"].chunks == list(range(100))
    assert set(result.processes) == {"producer", "middle"}
    assert result.edges["src->relay"]["sender"]["sent"] == 100  # reported back by the child
    assert result.edges["src->relay"]["sender"]["max_in_flight"] <= 3
    assert_no_stage_processes(result.processes.values())


def test_control_overtakes_queued_data():
    # Source fills the sink's whole window (capacity 10) and only then sends INTERRUPT; the sink
    # handles 1 message / 20 ms, so FIFO would put the control after all 10.
    graph = Graph(
        [
            Node("src", f"{STAGES}:Source", {"count": 10, "control_after": "interrupt"}),
            Node("sink", f"{STAGES}:Sink", {"expect": 10, "delay_s": 0.02}),
        ],
        [Edge("src", "sink", capacity=10)],
    )
    result = anyio.run(run_session, graph, PipelineConfig(), "s-ctl")
    assert result.ok, result.error
    sink = result.stages["sink"]
    assert sink.chunks == list(range(10))
    [(data_before, kind)] = sink.controls
    assert kind == ControlKind.INTERRUPT
    assert data_before <= 3, f"control waited behind {data_before} data messages"


def test_control_reaches_a_stage_waiting_inside_process():
    # GateSink's process() waits for a control message: without control_during_process this deadlocks
    # (fail_after raises and the session ends with an error).
    graph = Graph(
        [
            Node("src", f"{STAGES}:Source", {"count": 2, "control_after": "turn_start"}),
            Node("sink", f"{STAGES}:GateSink", {}),
        ],
        [Edge("src", "sink", capacity=2)],
    )
    result = anyio.run(run_session, graph, PipelineConfig(), "s-gate")
    assert result.ok, result.error
    assert result.stages["sink"].chunks == [0, 1]
    assert result.stages["sink"].controls[0] == ControlKind.TURN_START


@pytest.mark.parametrize("hosting", ["inproc", "processes"])
def test_a_failing_stage_ends_the_session_with_an_error_naming_it(hosting):
    graph = Graph(
        [
            Node("src", f"{STAGES}:Source", {"count": 50}),
            Node("fragile", f"{STAGES}:FailAfter", {"after": 5}, "worker"),
            Node("sink", f"{STAGES}:Sink", {}),
        ],
        [Edge("src", "fragile"), Edge("src", "sink")],
    )
    result = anyio.run(run_session, graph, PipelineConfig(hosting=hosting), "s-fail")
    assert not result.ok and result.failed_stage == "fragile"
    assert "'fragile'" in result.error and "boom after 5" in result.error
    assert result.stages["sink"].torn_down  # every stage is torn down, also on error
    if hosting == "processes":
        assert_no_stage_processes(result.processes.values())


def test_stop_ends_cleanly():
    async def main():
        session = SessionRunner(chain(10**6), PipelineConfig(), "s-stop")
        async with anyio.create_task_group() as tg:

            async def stop_soon():
                await session.started.wait()
                await anyio.sleep(0.1)
                session.stop("test over")

            tg.start_soon(stop_soon)
            return await session.run()

    result = anyio.run(main)
    assert result.ok and result.ended_by == "stop: test over"
    assert 0 < len(result.stages["sink"].chunks) < 10**6 and result.stages["sink"].torn_down


def _victim_graph(note_file: Path) -> Graph:
    return Graph(
        [
            Node("victim", f"{STAGES}:Idle", {"note_file": str(note_file)}, "doomed"),
            Node("sink", f"{STAGES}:Sink", {}),
        ],
        [Edge("victim", "sink")],
    )


@pytest.mark.parametrize("fault", ["SIGKILL", "SIGSTOP"])
def test_a_dead_or_frozen_stage_process_ends_the_session_naming_the_stage(fault, tmp_path):
    config = PipelineConfig(hosting="processes", transport=TransportConfig(heartbeat_s=0.1, dead_after_s=0.6))
    session = SessionRunner(_victim_graph(tmp_path / "victim.txt"), config, "s-kill")
    hit_at: list[float] = []

    async def main():
        async with anyio.create_task_group() as tg:

            async def strike():
                await session.started.wait()
                hit_at.append(time.monotonic())
                os.kill(session.pids["doomed"], getattr(signal, fault))

            tg.start_soon(strike)
            with anyio.fail_after(30):  # nothing hangs
                return await session.run()

    result = anyio.run(main)
    assert not result.ok and result.failed_stage == "victim"
    assert "'victim'" in result.error
    assert ("killed by signal SIGKILL" if fault == "SIGKILL" else "stopped answering heartbeats") in result.error
    assert session.ended_at - hit_at[0] < 2.0, f"noticed after {session.ended_at - hit_at[0]:.2f} s"
    assert_no_stage_processes(result.processes.values())


SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
import anyio
from charstream.pipeline.config import PipelineConfig
from charstream.pipeline.runtime.runner import Edge, Graph, Node, SessionRunner

def main():
    graph = Graph(
        [Node("victim", "test_runner_stages:Idle", {{"note_file": {note!r}}}, "doomed"),
         Node("sink", "test_runner_stages:Sink", {{}})],
        [Edge("victim", "sink")],
    )
    session = SessionRunner(graph, PipelineConfig(hosting="processes"), "s-signal")

    async def go():
        async with anyio.create_task_group() as tg:
            async def announce():
                await session.started.wait()
                print("STARTED", session.pids["doomed"], flush=True)
            tg.start_soon(announce)
            result = await session.run()
            print("RESULT", result.ok, result.ended_by, result.stages["sink"].torn_down, result.exit_codes, flush=True)

    anyio.run(go)

if __name__ == "__main__":
    main()
"""


def _start_script(tmp_path: Path, note: Path) -> tuple[subprocess.Popen, int]:
    script = tmp_path / "session_main.py"
    script.write_text(textwrap.dedent(SCRIPT.format(tests=str(TESTS_DIR), note=str(note))))
    env = {**os.environ, "CHARSTREAM_LOG_LEVEL": "error"}
    proc = subprocess.Popen([sys.executable, str(script)], cwd=REPO, stdout=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)  # its own process group, like a terminal job
    line = proc.stdout.readline()
    assert line.startswith("STARTED"), line
    return proc, int(line.split()[1])


def _wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not gone(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    return gone(pid)


@pytest.mark.parametrize("how", ["SIGTERM to the parent", "SIGINT to the process group"])
def test_signals_shut_down_cleanly(how, tmp_path):
    note = tmp_path / "clean.txt"
    proc, child = _start_script(tmp_path, note)
    if how.startswith("SIGTERM"):
        proc.send_signal(signal.SIGTERM)
    else:  # Ctrl-C in a terminal: every process of the job gets SIGINT; only the parent acts on it
        os.killpg(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert f"RESULT True signal {how.split()[0]} True {{'doomed': 0}}" in out  # the child exited cleanly too
    assert _wait_gone(child, 5)
    assert note.read_text().splitlines() == [f"pid {child}", "teardown"]  # the child tore down too


def test_parent_killed_leaves_no_orphans(tmp_path):
    proc, child = _start_script(tmp_path, tmp_path / "killed.txt")
    proc.kill()  # SIGKILL: the parent gets no chance to clean up; PDEATHSIG must take the child
    proc.wait(timeout=10)
    assert _wait_gone(child, 5)


def test_plan_gives_both_ends_of_an_edge_its_capacity(tmp_path):
    specs = plan_groups(chain(3, groups=("a", "b")), PipelineConfig(), "plan", str(tmp_path))
    inputs = {edge.name: (endpoint, capacity) for s in specs for edge, endpoint, capacity in s.inputs}
    outputs = {edge.name: (endpoint, capacity) for s in specs for edge, endpoint, capacity in s.outputs}
    assert outputs == inputs  # the sender's slot ring is sized like the receiver's credits
    assert sorted(c for _, c in inputs.values()) == [2, 3]


def test_a_stage_process_with_a_large_heap_exits_within_its_grace():
    """At a long session's end the diffusion process missed its 1 s grace and needed SIGTERM: after its
    report it ran the interpreter's teardown, collecting and freeing its whole heap."""

    graph = Graph([Node("hoard", f"{STAGES}:Hoard", {"objects": 3_000_000}, "big"),
                   Node("sink", f"{STAGES}:Sink", {})], [Edge("hoard", "sink")])
    result = _stop_after_start(graph, "s-heap")
    assert result.ok and result.exit_codes == {"big": 0}, result.exit_codes  # not -15: SIGTERM


def _stop_after_start(graph: Graph, session_id: str):
    async def main():
        session = SessionRunner(graph, PipelineConfig(hosting="processes"), session_id)
        async with anyio.create_task_group() as tg:

            async def stop_soon():
                await session.started.wait()
                session.stop("session over")

            tg.start_soon(stop_soon)
            return await session.run()

    return anyio.run(main)


def test_a_stage_process_that_ignores_the_stop_is_killed_and_reported(capfd):
    """Escalation is not silent: the result and a warning name the process, the signal and the time."""
    graph = Graph([Node("stuck", f"{STAGES}:Stubborn", {}, "stubborn"),
                   Node("idle", f"{STAGES}:Idle", {}, "willing"), Node("sink", f"{STAGES}:Sink", {})],
                  [Edge("stuck", "sink"), Edge("idle", "sink")])
    started = time.monotonic()
    result = _stop_after_start(graph, "s-stubborn")
    assert time.monotonic() - started < 30  # not the 30 s it would hold
    stuck, willing = result.stops["stubborn"], result.stops["willing"]
    # SIGTERM is ignored, so SIGKILL: after the 1 s grace and SIGTERM's 0.5 s.
    assert stuck["signal"] == "SIGKILL" and stuck["why"] == "grace exceeded" and stuck["exitcode"] == -9, stuck
    assert 1.5 <= stuck["exit_s"] < 3.0, stuck
    assert willing["signal"] is None and willing["exit_s"] < willing["grace_s"] and willing["exitcode"] == 0, willing
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("{")]
    warnings = [e for e in map(json.loads, lines) if e.get("event") == "stage_process_signalled"]
    assert [(w["process"], w["signal"]) for w in warnings] == [("stubborn", "SIGKILL")], warnings
    assert warnings[0]["level"] == "warning" and warnings[0]["exit_s"] == stuck["exit_s"]
