"""The one place for benchmark helpers: how figures are timed and summarised (CUDA-event medians,
percentiles), what identifies a run (commit id), a free loopback port for a process group, and how
figures are handed back: a table for people, JSON for tools (``--json``, ``--out``)."""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np


def emit_report(report: dict, table: str, out: str | None, as_json: bool) -> None:
    """Write ``report`` to ``out`` (if given); print the table, on stderr when JSON goes to stdout."""
    text = json.dumps(report, indent=2)
    if out:
        Path(out).write_text(text + "\n")
    print(table, file=sys.stderr if as_json else sys.stdout)
    if as_json:
        print(text)


def text_table(rows: Sequence[Sequence[str]]) -> str:
    """Rows of cells (the first the header) as left-aligned columns."""
    width = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, width, strict=True)).rstrip() for r in rows)


def percentiles(values: Iterable[float], points: Sequence[int] = (50, 99)) -> dict[str, float]:
    """``{"p50": ..., "p99": ...}`` of ``values`` (linear interpolation)."""
    data = np.asarray(list(values), dtype=float)
    return {f"p{p}": float(np.percentile(data, p)) for p in points}


def commit_id() -> str:
    """The commit measured: ``CHARSTREAM_COMMIT`` (set where the tree travels without .git), else git's."""
    if os.environ.get("CHARSTREAM_COMMIT"):
        return os.environ["CHARSTREAM_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def free_port() -> int:
    """A free TCP port on the loopback interface (a process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cuda_median_ms(fn: Callable[[], object], reps: int, warmup: int = 2) -> float:
    """Median GPU time of ``fn`` in ms: CUDA events around each call, after ``warmup`` calls."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
