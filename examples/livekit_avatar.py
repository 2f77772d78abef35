"""charstream as a LiveKit Agents avatar worker (needs the extra: pip install -e '.[livekit]').

LiveKit's avatar pattern: the agent (STT/LLM/TTS) runs in the room and streams its TTS audio to an
avatar participant over a data stream (``DataStreamAudioOutput`` on the agent side); the avatar
participant renders video and publishes audio + video. This script is that avatar participant,
rendering with charstream:

    export LIVEKIT_URL=wss://... LIVEKIT_TOKEN=<token for identity "charstream-avatar">
    python examples/livekit_avatar.py --room my-room

and, in the agent, ``charstream.pipeline.integrations.livekit_plugin.AvatarSession`` (it runs this
participant in the agent's process and points the agent's audio at it), or by hand
``session.output.audio = DataStreamAudioOutput(room, destination_identity="charstream-avatar")``.
It returns when the room disconnects or the agent it serves leaves (``serve_avatar``; the tests run
it in a stand-in room, tests/test_livekit.py).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from livekit import rtc
from livekit.agents.voice.avatar import DataStreamAudioReceiver

from charstream.pipeline.config import PipelineConfig
from charstream.pipeline.integrations.livekit import serve_avatar


async def run(url: str, token: str, room_name: str, preset: str, agent_identity: str | None) -> None:
    room = rtc.Room()
    await room.connect(url, token)
    try:
        reason = await serve_avatar(room, DataStreamAudioReceiver(room), PipelineConfig(preset=preset), room_name,
                                    agent_identity)
        print(f"charstream avatar stopped: {reason}")
    finally:
        await room.disconnect()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--room", required=True)
    parser.add_argument("--url", default=os.environ.get("LIVEKIT_URL"))
    parser.add_argument("--token", default=os.environ.get("LIVEKIT_TOKEN"))
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--agent-identity", default=None, help="stop when this participant (the agent) leaves")
    args = parser.parse_args(argv)
    if not args.url or not args.token:
        parser.error("a LiveKit server is needed: --url/--token or LIVEKIT_URL/LIVEKIT_TOKEN")
    asyncio.run(run(args.url, args.token, args.room, args.preset, args.agent_identity))
    return 0


if __name__ == "__main__":
    sys.exit(main())
