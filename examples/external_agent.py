"""An external voice agent driving charstream over ZeroMQ (protocol: docs/AGENTS.md).

Run charstream with ``ingest.adapter = "zmq"`` (it binds ``ingest.zmq_endpoint``), then:

    python examples/external_agent.py --endpoint tcp://127.0.0.1:5790 \
        --line "Hello! I'm speaking from another process." --line "Ask me anything."

The agent says hello, then for each line: waits (a pause, or with ``--wait-for-user`` the user's end
of speech that charstream's VAD reports), synthesises the line with espeak-ng, and streams it as
20 ms frames of PCM at real-time pace. An ``interrupt`` (the user barged in) stops the line at once.
It pings every 0.5 s while idle, so charstream knows it is alive. Each thing that happens is printed
as one JSON line on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from charstream.pipeline.integrations.agent_client import ExternalAgentClient


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--endpoint", default="tcp://127.0.0.1:5790")
    parser.add_argument("--session", default=None,
                        help="the session token to join (serve prints it); default: the oldest session waiting")
    parser.add_argument("--line", action="append", help="a line to speak (repeat for several turns)")
    parser.add_argument("--rate", type=int, default=24_000, help="sample rate to send at")
    parser.add_argument("--format", default="s16le", choices=["s16le", "f32le"])
    parser.add_argument("--voice", default="en+f3")
    parser.add_argument("--pause", type=float, default=0.5, help="seconds before each line")
    parser.add_argument("--wait-for-user", action="store_true", help="speak after each user end of speech")
    parser.add_argument("--linger", type=float, default=0.2, help="seconds to stay connected at the end")
    args = parser.parse_args(argv)
    lines = args.line or ["Hello! I am an external agent, speaking through charstream."]
    agent = ExternalAgentClient(args.endpoint, args.rate, args.format, args.voice, session=args.session)
    asyncio.run(agent.run(lines, args.pause, args.wait_for_user, args.linger))
    return 0


if __name__ == "__main__":
    sys.exit(main())
