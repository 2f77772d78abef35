"""Replay logged turn starts through the speech estimate's prior (stages/playout/speech_estimate.py), offline:
which late onsets the allowance ``max(learned, prior)`` would have placed in time, and at what latency.

Reads logs at info level (``bench capacity --log-level info``'s capacity.log, ``demo --verbose``): each
turn start's ``playout_rollback`` (its estimate, its allowance as the session learned it, the onset's
deadline) and ``playout_speech_arrived`` (when its first chunk came, the margin to that deadline). A
larger allowance moves the onset to the first frame at or after the later ready time: ``k`` frames
later, the margin ``k`` frames more. The chunk's own arrival is taken as it was (a later placement
leaves its production unchanged), so this is an estimate of the rule, not a run of it.

    python scripts/replay_onset_prior.py capacity.log [more logs] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

from charstream.logs import read_events
from charstream.stages.config import PlayoutConfig
from charstream.stages.playout.speech_estimate import prior_allowance
from charstream.timeline import CHARACTERS

FRAME_MS = 1000 / CHARACTERS.fps


def onsets(log: Path) -> list[tuple[dict, dict]]:
    """(placement, first chunk's arrival) of every turn start, in time order per session."""
    placed, pairs = {}, []
    for e in sorted(read_events(log), key=lambda e: e.get("timestamp", "")):
        session = e.get("session_id")
        if e.get("event") == "playout_rollback" and e.get("reason") == "turn_start":
            placed[session] = e
        elif e.get("event") == "playout_speech_arrived" and session in placed:
            pairs.append((placed.pop(session), e))
    return pairs


def replay(log: Path, initial_allowance_s: float) -> dict:
    turns: dict[str, int] = {}
    rows = []
    for placement, arrival in onsets(log):
        session = placement["session_id"]
        before = turns.get(session, 0)  # this session's turns placed before this one
        turns[session] = before + 1
        learned, slack = placement["allowance_ms"], placement["due_in_ms"] - placement["ready_in_ms"]
        if before == 0:  # the first turn ran with the prior alone, as now
            extra = 0.0
        else:
            extra = max(learned, prior_allowance(initial_allowance_s, before) * 1e3) - learned
        frames = math.ceil((extra - slack) / FRAME_MS) if extra > slack else 0
        rows.append({"session": session, "turn": turns[session], "margin_ms": arrival["margin_ms"],
                     "replayed_margin_ms": round(arrival["margin_ms"] + frames * FRAME_MS, 1),
                     "later_ms": round(frames * FRAME_MS, 1)})
    by_turn: dict[int, list[float]] = {}
    for r in rows:
        by_turn.setdefault(r["turn"], []).append(r["later_ms"])
    return {"log": str(log), "onsets": len(rows), "late": sum(r["margin_ms"] < 0 for r in rows),
            "late_replayed": sum(r["replayed_margin_ms"] < 0 for r in rows),
            "later_ms_mean": round(statistics.mean(r["later_ms"] for r in rows), 1) if rows else 0.0,
            "later_ms_mean_by_turn": {t: round(statistics.mean(v), 1) for t, v in sorted(by_turn.items())},
            "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("logs", nargs="+", type=Path)
    allowance = PlayoutConfig().initial_allowance_s
    allowance = CHARACTERS.chunk_seconds if allowance is None else allowance  # None: one chunk (the logs' timeline)
    parser.add_argument("--initial-allowance-ms", type=float, default=allowance * 1e3)
    parser.add_argument("--json", type=Path, help="write every onset's row here")
    args = parser.parse_args()
    results = [replay(log, args.initial_allowance_ms / 1e3) for log in args.logs]
    print(f"{'log':48} {'onsets':>6} {'late':>5} {'late, replayed':>15} {'later ms (mean)':>16}  by turn")
    for r in results:
        turns = ", ".join(f"{t}: {v:g}" for t, v in list(r["later_ms_mean_by_turn"].items())[:6])
        print(f"{r['log'][-48:]:48} {r['onsets']:>6} {r['late']:>5} {r['late_replayed']:>15} {r['later_ms_mean']:>16}  {turns}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
