"""Prometheus as a host application sees it: an embedded session with ``hosting = "processes"``
(diffusion's step time is recorded in a spawned child) is scraped over HTTP, process metrics
included, on loopback; the child's series go with the session; ``serve`` honours the configured
metrics port."""

import queue
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from charstream.stages.shared.metrics import collector

EMBEDDED = """
import asyncio, sys
from charstream.pipeline.config import PipelineConfig
from charstream.pipeline.integrations.embedded import EmbeddedSession

async def main():
    config = PipelineConfig(hosting="processes")
    config.transport.dead_after_s = 30.0  # what is tested is the scrape: a loaded 2-core VM may stall a process
    config.ingest.adapter = "pipecat"
    config.tracing.prometheus_port = int(sys.argv[1])
    session = EmbeddedSession(config, "scraped")
    await session.start()
    print("started", flush=True)
    await asyncio.to_thread(sys.stdin.readline)
    result = await session.stop()
    print("stopped", result.ok, sorted(result.processes), flush=True)
    await asyncio.to_thread(sys.stdin.readline)

asyncio.run(main())
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[str, list]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    families: dict[str, list] = {}
    for family in text_string_to_metric_families(text):  # fails on a malformed page (a name twice, say)
        assert family.name not in families, f"{family.name} appears twice"
        families[family.name] = family.samples
    return families


def step_count(families: dict[str, list], session: str) -> float:
    return sum(s.value for s in families.get("charstream_step_seconds", [])
               if s.name == "charstream_step_seconds_count" and s.labels.get("session") == session)


def listening_addresses(port: int) -> set[str]:
    """Local addresses with a listening TCP socket on ``port`` (from /proc/net/tcp{,6})."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.rsplit(":", 1)
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.add(address)
    return found


def marker_lines(stream) -> queue.Queue:
    """The script's own lines from its stdout, read as they come (its JSON logs share the pipe: an
    unread pipe would fill and stall it)."""
    lines: queue.Queue = queue.Queue()

    def read() -> None:
        for line in stream:
            if not line.startswith("{"):
                lines.put(line)

    threading.Thread(target=read, daemon=True).start()
    return lines


def test_a_scrape_sees_step_time_from_the_stage_processes(tmp_path):
    port = free_port()
    log = tmp_path / "session.err"
    child = subprocess.Popen([sys.executable, "-c", EMBEDDED, str(port)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=log.open("w"), text=True)
    lines = marker_lines(child.stdout)
    try:
        assert lines.get(timeout=180).strip() == "started"
        deadline, families = time.monotonic() + 120, {}
        while time.monotonic() < deadline and step_count(families, "scraped") < 3:
            time.sleep(0.5)
            families = scrape(port)
        assert step_count(families, "scraped") >= 3, ("no step time from the diffusion process",
                                                      log.read_text()[-3000:])
        assert families["process_cpu_seconds"][0].value > 0  # the serving process's own metrics
        assert families["process_resident_memory_bytes"][0].value > 0
        assert any(s.labels.get("session") == "scraped" for s in families["charstream_fps"])  # playout, here
        assert listening_addresses(port) == {"0100007F"}  # 127.0.0.1 only
        child.stdin.write("\n")
        child.stdin.flush()
        stopped = lines.get(timeout=60).split()
        assert stopped[:2] == ["stopped", "True"] and "diffusion" in " ".join(stopped[2:]), stopped
        assert step_count(scrape(port), "scraped") == 0  # the ended session's series went with it
    finally:
        child.kill()
        child.wait(10)


def test_serve_honours_the_configured_metrics_port(tmp_path):
    port = free_port()
    config = tmp_path / "serve.toml"
    config.write_text(f"[tracing]\nprometheus_port = {port}\n[egress]\nport = 0\n")
    server = subprocess.Popen([sys.executable, "-m", "charstream", "serve", "--source", "testcard", "--config",
                               str(config)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        lines = [server.stdout.readline() for _ in range(2)]
        assert f"metrics on http://127.0.0.1:{port}/metrics" in lines[0], lines
        families = scrape(port)
        assert "charstream_session_average_fps" in families and "process_open_fds" in families
        assert listening_addresses(port) == {"0100007F"}
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def test_a_host_registry_takes_our_collector():
    host = CollectorRegistry()
    host.register(collector())
    text = generate_latest(host).decode()
    assert "# TYPE charstream_step_seconds histogram" in text and text.count("# TYPE charstream_fps gauge") == 1

