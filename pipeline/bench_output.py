"""How a benchmark hands back its figures: a table for people, JSON for tools (``--json``, ``--out``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def emit_report(report: dict, table: str, out: str | None, as_json: bool) -> None:
    """Write ``report`` to ``out`` (if given); print the table, on stderr when JSON goes to stdout."""
    text = json.dumps(report, indent=2)
    if out:
        Path(out).write_text(text + "\n")
    print(table, file=sys.stderr if as_json else sys.stdout)
    if as_json:
        print(text)
