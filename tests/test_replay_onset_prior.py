"""scripts/replay_onset_prior.py: logged turn starts replayed through the allowance's prior."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "replay_onset_prior.py"


def _placement(session: str, t: str, allowance: float, ready: float, due: float) -> dict:
    return {"session_id": session, "event": "playout_rollback", "reason": "turn_start", "timestamp": t,
            "allowance_ms": allowance, "ready_in_ms": ready, "due_in_ms": due}


def _arrival(session: str, t: str, margin: float) -> dict:
    return {"session_id": session, "event": "playout_speech_arrived", "timestamp": t, "margin_ms": margin}


def test_a_late_onset_the_prior_covers_moves_whole_frames_later_and_one_it_does_not_stays_late(tmp_path):
    events = [  # two sessions' turns 1 and 2; turn 2 late in both
        _placement("a", "T01", 166.7, 180.0, 200.0), _arrival("a", "T02", 10.0),
        _placement("b", "T03", 166.7, 170.0, 190.0), _arrival("b", "T04", 15.0),
        _placement("a", "T05", 0.0, 50.0, 55.0), _arrival("a", "T06", -10.0),  # prior 83.3 ms > its 5 ms slack
        _placement("b", "T07", 100.0, 150.0, 160.0), _arrival("b", "T08", -30.0),  # learned 100 > prior: as it was
    ]
    log = tmp_path / "capacity.log"  # two processes' lines interleaved on one line, as on a shared stderr
    log.write_text(json.dumps(events[0]) + json.dumps(events[1]) + "\n"
                   + "\n".join(json.dumps(e) for e in events[2:]) + "\n", encoding="utf-8")
    out = tmp_path / "replay.json"
    done = subprocess.run([sys.executable, str(SCRIPT), str(log), "--json", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    [result] = json.loads(out.read_text())
    assert (result["onsets"], result["late"], result["late_replayed"]) == (4, 2, 1)
    rows = {(r["session"], r["turn"]): r for r in result["rows"]}
    assert rows[("a", 1)]["later_ms"] == 0.0 and rows[("b", 2)]["later_ms"] == 0.0
    # 83.3 ms more than the 5 ms of slack: two frames later, the margin two frames more
    assert rows[("a", 2)]["later_ms"] == pytest.approx(2000 / 24, abs=0.1)
    assert rows[("a", 2)]["replayed_margin_ms"] == pytest.approx(-10 + 2000 / 24, abs=0.1)
    assert "capacity.log" in done.stdout
