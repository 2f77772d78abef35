"""``charstream fleet status`` and ``charstream fleet drain NODE``: a running front door, asked over HTTP.

    charstream fleet status --url http://127.0.0.1:8080 --key KEY [--json]
    charstream fleet drain NODE_ID_PREFIX --url ... --key KEY

Status prints the nodes (state, sessions, free layouts), the live sessions (node, time played,
average fps) and fleet health (the share of sessions averaging <= slow_fps). Drain stops a node
taking new sessions; its running sessions play on until they end.
"""

from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    if parser.prog.endswith("drain"):
        parser.add_argument("node", help="the node's id, or enough of its start to be unique")
    parser.add_argument("--url", default="http://127.0.0.1:8080", help="the front door (charstream serve --cluster)")
    parser.add_argument("--key", required=True, help="the front door's server key")
    if parser.prog.endswith("status"):
        parser.add_argument("--json", action="store_true", help="print the status as JSON")


def request(url: str, key: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"X-Charstream-Key": key, "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise ValueError(f"HTTP {e.code}: {json.loads(e.read() or b'{}').get('error', '')}") from None


def format_status(status: dict[str, Any]) -> str:
    lines = [f"layout {status['layout']}: {len(status['bundles'])} bundles per session {status['bundles']}", "",
             f"{'node':<14}{'state':<10}{'sessions':>9}{'free layouts':>14}"]
    lines += [f"{n['node_id'][:12]:<14}{n['state']:<10}{n['sessions']:>9}{n['free_layouts']:>14}" for n in status["nodes"]]
    lines += ["", f"{'session':<14}{'node':<14}{'played s':>9}{'avg fps':>9}{'page fps':>10}"]
    lines += [f"{s['session_id']:<14}{s['node_id'][:12]:<14}{s['played_s']:>9.1f}{_fps(s['average_fps']):>9}"
              f"{_fps(s['presented_fps']):>10}" for s in status["sessions"]]
    health = status["health"]
    share = "-" if health["slow_share"] is None else f"{100 * health['slow_share']:.1f}%"
    admissions = ", ".join(f"{k} {v}" for k, v in status["admissions"].items())
    lines += ["", f"health: {health['slow']} of {health['measured']} measured sessions averaging <= "
              f"{health['slow_fps']} fps ({share})", f"admissions: {admissions}"]
    return "\n".join(lines)


def _fps(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def run(args: argparse.Namespace) -> int:
    base = args.url.rstrip("/")
    try:
        if args.subcommand == "drain":
            node = request(f"{base}/fleet/drain", args.key, {"node": args.node})
            print(f"node {node['node_id'][:12]} {node['state']}: {node['sessions']} sessions play on, no new ones")
            return 0
        status = request(f"{base}/fleet/status", args.key)
    except (ValueError, OSError) as e:
        print(f"charstream fleet {args.subcommand}: {e}")
        return 2
    print(json.dumps(status, indent=2) if args.json else format_status(status))
    return 0
