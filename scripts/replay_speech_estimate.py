"""Replay a live session's turn starts through playout's speech estimate (stages/playout/speech_estimate.py)
and its placement rule, offline: what each turn's speech would have been placed for, whether its
first chunk (as it really arrived) would have been in time, and the pipeline latency that gives.

Reads a ``charstream demo --verbose`` log (``turn start``, ``playout_rollback``,
``playout_speech_arrived``, ``client_first_speaking_frame``, ``user_speech_end``) and the run's
report.md (the turns' stamps). The log holds no listening chunk's stamps, so the estimator's history
is the turns' first chunks that found the step idle (``last_emit_at`` at least ``--idle-ms`` before
the turn start), as a listening chunk does: their step (``conditioning_ready`` -> ``diffusion_done``)
and delivery (``diffusion_done`` -> arrival) parts. Each placement uses only the turns before it.

    python scripts/replay_speech_estimate.py LOG REPORT.md [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
from pathlib import Path

from charstream.logs import read_events
from charstream.stages.config import PlayoutConfig
from charstream.stages.playout.speech_estimate import SpeechEstimator
from charstream.timeline import FRAMES_PER_CHUNK, VIDEO_FPS

FRAME = 1 / VIDEO_FPS
CHUNK = FRAMES_PER_CHUNK * FRAME


def wall(iso: str) -> float:
    return datetime.datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def report_stamps(report: Path) -> dict[int, dict[str, float]]:
    """The report's turn table: ms after the user's end of speech, per turn."""
    names = ("agent_first_audio", "conditioning_ready", "diffusion_done", "decode_done",
             "playout_first_speaking_frame", "client_first_speaking_frame")
    turns = {}
    for line in report.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 7 and cells[0].isdigit():
            turns[int(cells[0])] = dict(zip(names, map(float, cells[1:]), strict=True))
    return turns


def place(rollback_at: float, ready: float, interval: float, grid_due: float, grid_onset: int, grid_chunk: int,
          earliest: int) -> float:
    """Playout's rule on the session's frame grid: the first frame due at or after ``ready`` (from
    the rollback) whose next chunk is not due before ``ready + interval``, in a chunk >= ``earliest``.
    The grid: frame ``grid_onset`` of chunk ``grid_chunk`` is due at ``grid_due``."""
    chunk0_start = grid_due - grid_onset * FRAME - grid_chunk * CHUNK  # where chunk 0 would start
    frame = math.ceil((rollback_at + ready - chunk0_start) / FRAME - 1e-9)
    while chunk0_start + (frame // FRAMES_PER_CHUNK + 1) * CHUNK < rollback_at + ready + interval:
        frame += 1
    frame = max(frame, 4 * earliest)
    return chunk0_start + frame * FRAME


def replay(log: Path, report: Path, idle_ms: float) -> list[dict]:
    ev = read_events(log)
    starts = [e for e in ev if e.get("event") == "turn start"]
    rollbacks = [e for e in ev if e.get("event") == "playout_rollback"]
    arrivals = [e for e in ev if e.get("event") == "playout_speech_arrived"]
    clients = {e["turn_id"]: e for e in ev if e.get("event") == "client_first_speaking_frame"}
    speech_end = {e["turn_id"]: e["at"] for e in ev if e.get("event") == "user_speech_end"}
    stamps = report_stamps(report)
    est, rows = SpeechEstimator(initial_allowance_s=PlayoutConfig().initial_allowance_s), []
    for ts, rb, arr in zip(starts, rollbacks, arrivals, strict=True):
        turn = ts["turn_id"]
        at_ts, at_rb, at_arr = wall(ts["timestamp"]), wall(rb["timestamp"]), wall(arr["timestamp"])
        s = {k: speech_end[turn] + v / 1e3 for k, v in stamps[turn].items()}
        row = {"turn": turn, "busy_ago_ms": round((at_ts - ts["last_emit_at"]) * 1e3, 1),
               "encode_ms": round(ts["encode_s"] * 1e3, 1), "arrived_ms": round((at_arr - at_rb) * 1e3, 1),
               "old_due_ms": rb["due_in_ms"], "old_pipeline_ms": clients[turn]["segments_ms"]["pipeline"]}
        if est.measured:
            e = est.estimate(at_rb, ts["encode_s"], ts["last_emit_at"])
            due = place(at_rb, e.ready_s, max(e.step_s, ts["encode_s"]), at_rb + rb["due_in_ms"] / 1e3,
                        rb["onset_frame"], rb["last_kept"] + 1, ts["earliest_chunk"])
            row.update(ready_ms=round(e.ready_s * 1e3, 1), allowance_ms=round(e.allowance_s * 1e3, 1),
                       new_due_ms=round((due - at_rb) * 1e3, 1), new_margin_ms=round((due - at_arr) * 1e3, 1),
                       new_pipeline_ms=round(row["old_pipeline_ms"] - (rb["due_in_ms"] / 1e3 - (due - at_rb)) * 1e3, 1))
            est.speech_arrived(at_arr - (at_rb + e.expected_s))
            est.end_turn()
        # A first chunk whose step found the step idle joins the history the next turns are estimated from.
        if row["busy_ago_ms"] >= idle_ms:
            est.observe({"conditioning_ready": s["conditioning_ready"], "diffusion_done": s["diffusion_done"]}, at_arr)
        rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log", type=Path)
    parser.add_argument("report", type=Path)
    parser.add_argument("--idle-ms", type=float, default=130.0,
                        help="a turn start this long after the last listening chunk found the step idle")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = replay(args.log, args.report, args.idle_ms)
    keys = ["turn", "busy_ago_ms", "encode_ms", "arrived_ms", "old_due_ms", "ready_ms", "allowance_ms", "new_due_ms",
            "new_margin_ms", "old_pipeline_ms", "new_pipeline_ms"]
    print("  ".join(keys))
    for r in rows:
        print("  ".join(str(r.get(k, "-")) for k in keys))
    placed = [r for r in rows if "new_due_ms" in r]
    summary = {"turns": len(rows), "replayed": len(placed),
               "old_pipeline_median_ms": statistics.median(r["old_pipeline_ms"] for r in placed),
               "new_pipeline_median_ms": statistics.median(r["new_pipeline_ms"] for r in placed),
               "new_onset_late": sum(r["new_margin_ms"] < 0 for r in placed),
               "new_margin_min_ms": min(r["new_margin_ms"] for r in placed)}
    print(json.dumps(summary))
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "summary": summary}, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
