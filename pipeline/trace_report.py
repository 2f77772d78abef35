"""``charstream trace report TRACE.jsonl [--out DIR]``: latency per segment and a waterfall.

Reads the ``turn`` lines ``charstream.stages.shared.tracing`` writes, recomputes every interval from the raw stamps
(the stored segments are a convenience, not the source), prints median and p90 per segment
(agent, pipeline, delivery, total) and per stage, and writes ``report.md``, ``report.json`` (the
same numbers, seconds) and ``waterfall.png``.
Percentiles interpolate linearly between order statistics (numpy's default).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from charstream.stages.shared.tracing import SEGMENTS, STAGES, intervals, read_jsonl
from charstream.timeline import TRACE_POINTS

# Reference medians (docs/ARCHITECTURE.md, Reference numbers) for comparison, seconds.
REFERENCE = {"agent": 1.42, "pipeline": 0.49, "delivery": 0.19, "total": 2.13}


@dataclass
class Row:
    name: str
    kind: str  # "segment" | "stage"
    n: int
    median: float | None
    p90: float | None


@dataclass
class Summary:
    turns: int
    complete: int
    rows: list[Row]

    def row(self, name: str, kind: str = "segment") -> Row:
        return next(r for r in self.rows if r.name == name and r.kind == kind)


def summarize(turns: list[dict[str, Any]]) -> Summary:
    per_turn = [t.get("stamps", {}) for t in turns]
    rows = []
    for kind, table in (("segment", SEGMENTS), ("stage", STAGES)):
        for name in table:
            values = np.array([v for s in per_turn if (v := intervals(s, {name: table[name]}).get(name)) is not None])
            if len(values):
                rows.append(Row(name, kind, len(values), float(np.median(values)), float(np.percentile(values, 90))))
            else:
                rows.append(Row(name, kind, 0, None, None))
    complete = sum(all(p in s for p in TRACE_POINTS) for s in per_turn)
    return Summary(len(turns), complete, rows)


def _ms(seconds: float | None) -> str:
    return "—" if seconds is None else f"{seconds * 1e3:.0f}"


def render_table(summary: Summary) -> str:
    lines = [f"{summary.turns} turns ({summary.complete} with all {len(TRACE_POINTS)} stamps)",
             f"{'kind':<9}{'name':<14}{'n':>4}{'median ms':>11}{'p90 ms':>9}{'ref ms':>9}"]
    for r in summary.rows:
        ref = _ms(REFERENCE.get(r.name)) if r.kind == "segment" else ""
        lines.append(f"{r.kind:<9}{r.name:<14}{r.n:>4}{_ms(r.median):>11}{_ms(r.p90):>9}{ref:>9}")
    return "\n".join(lines)


def render_markdown(summary: Summary, turns: list[dict[str, Any]], waterfall: str | None = "waterfall.png") -> str:
    out = ["# Turn latency report", "",
           f"{summary.turns} turns, {summary.complete} with all {len(TRACE_POINTS)} contract timestamps. "
           "Medians and p90 in milliseconds; reference = the public 57B system (docs/ARCHITECTURE.md, Reference numbers).", "",
           "| kind | name | n | median | p90 | reference median |", "|---|---|---:|---:|---:|---:|"]
    for r in summary.rows:
        ref = _ms(REFERENCE.get(r.name)) if r.kind == "segment" and r.name in REFERENCE else ""
        out.append(f"| {r.kind} | {r.name} | {r.n} | {_ms(r.median)} | {_ms(r.p90)} | {ref} |")
    out += ["", "## Turns (ms after the user's end of speech)", "",
            "| turn | " + " | ".join(TRACE_POINTS[1:]) + " |", "|---:|" + "---:|" * (len(TRACE_POINTS) - 1)]
    for t in turns:
        stamps = t.get("stamps", {})
        origin = stamps.get("user_speech_end")
        cells = [_ms(stamps[p] - origin) if origin is not None and p in stamps else "—" for p in TRACE_POINTS[1:]]
        out.append(f"| {t.get('turn_id')} | " + " | ".join(cells) + " |")
    if waterfall:
        out += ["", f"![waterfall]({waterfall})"]
    return "\n".join(out) + "\n"


def draw_waterfall(turns: list[dict[str, Any]], path: str | Path) -> None:
    """One row per turn: each stage's span as a bar from the user's end of speech, in ms."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never a display
    import matplotlib.pyplot as plt

    colors = dict(zip(STAGES, plt.get_cmap("tab10").colors, strict=False))
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.45 * max(1, len(turns))))
    labels = []
    for row, t in enumerate(turns):
        stamps = t.get("stamps", {})
        origin = stamps.get("user_speech_end", min(stamps.values(), default=0.0))
        for name, (a, b) in STAGES.items():
            if a in stamps and b in stamps:
                ax.barh(row, (stamps[b] - stamps[a]) * 1e3, left=(stamps[a] - origin) * 1e3, color=colors[name],
                        label=name if name not in ax.get_legend_handles_labels()[1] else None)
        labels.append(f"turn {t.get('turn_id')}")
    ax.axvline(REFERENCE["total"] * 1e3, color="0.4", linestyle="--", linewidth=1,
               label="reference total (median)")
    ax.set_yticks(range(len(turns)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("ms after the user's end of speech")
    ax.set_title("Turn waterfall: user_speech_end → client_first_speaking_frame")
    # Below the axes, clear of the bars; bbox_inches="tight" keeps it in the image.
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.25), fontsize="small", ncols=7, frameon=False)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def to_json(summary: Summary, trace_path: str | Path) -> dict[str, Any]:
    return {"trace": str(trace_path), "turns": summary.turns, "complete": summary.complete,
            "rows": [{"kind": r.kind, "name": r.name, "n": r.n, "median_s": r.median, "p90_s": r.p90}
                     for r in summary.rows]}


def write_report(trace_path: str | Path, out_dir: str | Path) -> Summary:
    """Summarise ``trace_path`` into ``out_dir``: report.md, report.json and waterfall.png."""
    turns = read_jsonl(trace_path)
    summary = summarize(turns)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    draw_waterfall(turns, out / "waterfall.png")
    (out / "report.md").write_text(render_markdown(summary, turns), encoding="utf-8")
    (out / "report.json").write_text(json.dumps(to_json(summary, trace_path), indent=1) + "\n", encoding="utf-8")
    return summary


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", help="a trace.jsonl written by a charstream session")
    parser.add_argument("--out", default=None, help="directory for report.md and waterfall.png "
                                                    "(default: the trace file's directory)")


def run(args: argparse.Namespace) -> int:
    trace = Path(args.trace)
    if not trace.is_file():
        print(f"charstream trace report: no such file: {trace}")
        return 2
    try:
        summary = write_report(trace, args.out or trace.parent)
    except ValueError as e:
        print(f"charstream trace report: {e}")
        return 2
    print(render_table(summary))
    out = Path(args.out or trace.parent)
    print(f"wrote {out / 'report.md'}, {out / 'report.json'} and {out / 'waterfall.png'}")
    return 0 if summary.turns else 1
