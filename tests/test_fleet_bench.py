"""``charstream bench fleet`` end to end on a small local cluster: a table, JSON, a refusal past capacity."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_fleet_measures_sessions_and_reports_a_full_fleet(tmp_path):
    out = tmp_path / "fleet.json"
    done = subprocess.run([sys.executable, "-m", "charstream", "bench", "fleet", "--nodes", "2,2", "--sessions", "2,3",
                           "--seconds", "3", "--out", str(out)], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    ran, refused = report["steps"]
    # Two sessions, one per node (each holds one cpu layout), frames flowing at both ends.
    assert ran["sessions"] == 2 and ran.get("nodes_used") == 2, ran  # a refused step says why
    assert min(ran["node_fps"]) > 0 and min(ran["client_fps"]) > 0
    assert ran["slow"] == sum(f <= report["slow_fps"] for f in ran["node_fps"])
    assert refused["sessions"] == 3 and "503" in refused["refused"]
    assert "fleet load test: test-card sessions, layout cpu" in done.stdout
