"""charstream as a LiveKit Agents avatar worker (needs the extra: pip install -e '.[livekit]').

LiveKit's avatar pattern: the agent (STT/LLM/TTS) runs in the room and streams its TTS audio to an
avatar participant over a data stream (``DataStreamAudioOutput`` on the agent side); the avatar
participant renders video and publishes audio + video. This script is that avatar participant,
rendering with charstream:

    export LIVEKIT_URL=wss://... LIVEKIT_TOKEN=<token for identity "charstream-avatar">
    python examples/livekit_avatar.py --room my-room

and, in the agent, ``session.output.audio = DataStreamAudioOutput(room, destination_identity="charstream-avatar")``.
It needs a LiveKit server, so the test suite checks the generator at its interface instead
(tests/test_livekit.py).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from charstream.model.config import get_preset
from charstream.pipeline.config import PipelineConfig
from charstream.pipeline.integrations.avatar_session import AvatarSession
from charstream.pipeline.integrations.livekit import CharstreamVideoGenerator
from livekit import rtc
from livekit.agents.voice.avatar import AvatarOptions, AvatarRunner, DataStreamAudioReceiver

from charstream.timeline import TIMELINE_RATE, VIDEO_FPS


async def run(url: str, token: str, room_name: str, preset: str) -> None:
    config = PipelineConfig(preset=preset)
    config.ingest.adapter = "livekit"
    session = AvatarSession(config, room_name)
    await session.start()
    room = rtc.Room()
    await room.connect(url, token)
    model = get_preset(preset)
    runner = AvatarRunner(
        room,
        audio_recv=DataStreamAudioReceiver(room),
        video_gen=CharstreamVideoGenerator(session),
        options=AvatarOptions(video_width=model.width, video_height=model.height, video_fps=VIDEO_FPS,
                              audio_sample_rate=TIMELINE_RATE, audio_channels=1),
    )
    try:
        await runner.start()
        await runner.wait_for_complete()
    finally:
        await runner.aclose()
        await session.stop("livekit room closed")
        await room.disconnect()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--room", required=True)
    parser.add_argument("--url", default=os.environ.get("LIVEKIT_URL"))
    parser.add_argument("--token", default=os.environ.get("LIVEKIT_TOKEN"))
    parser.add_argument("--preset", default="tiny")
    args = parser.parse_args(argv)
    if not args.url or not args.token:
        parser.error("a LiveKit server is needed: --url/--token or LIVEKIT_URL/LIVEKIT_TOKEN")
    asyncio.run(run(args.url, args.token, args.room, args.preset))
    return 0


if __name__ == "__main__":
    sys.exit(main())
