"""charstream as a LiveKit Agents avatar worker (needs the extra: pip install -e '.[livekit]').

LiveKit's avatar pattern: the agent (STT/LLM/TTS) runs in the room and streams its TTS audio to an
avatar participant over a data stream (``DataStreamAudioOutput`` on the agent side); the avatar
participant renders video and publishes audio + video. This script is that avatar participant,
rendering with charstream:

    export LIVEKIT_URL=wss://... LIVEKIT_TOKEN=<token for identity "charstream-avatar">
    python examples/livekit_avatar.py --room my-room

and, in the agent, ``charstream.pipeline.integrations.livekit_plugin.AvatarSession`` (it starts this
worker and points the agent's audio at it), or by hand
``session.output.audio = DataStreamAudioOutput(room, destination_identity="charstream-avatar")``.
It returns when the room disconnects or the agent it serves leaves. The tests run ``serve`` with a
stand-in room (tests/test_livekit.py).
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
from livekit.agents.voice.avatar import AudioReceiver, AvatarOptions, AvatarRunner, DataStreamAudioReceiver

from charstream.timeline import TIMELINE_RATE, VIDEO_FPS


async def serve(room: rtc.Room, audio_recv: AudioReceiver, config: PipelineConfig, session_id: str,
                agent_identity: str | None = None) -> str:
    """Render the character in ``room`` until the room disconnects, ``agent_identity`` leaves, or the
    session ends; returns why it stopped."""
    config.ingest.adapter = "livekit"
    session = AvatarSession(config, session_id)
    await session.start()
    model = get_preset(config.preset)
    runner = AvatarRunner(
        room, audio_recv=audio_recv, video_gen=CharstreamVideoGenerator(session),
        options=AvatarOptions(video_width=model.width, video_height=model.height, video_fps=VIDEO_FPS,
                              audio_sample_rate=TIMELINE_RATE, audio_channels=1),
    )
    loop = asyncio.get_running_loop()
    gone: asyncio.Future[str] = loop.create_future()

    def finish(reason: str) -> None:
        if not gone.done():
            gone.set_result(reason)

    def on_disconnected(reason: object = None) -> None:
        finish(f"room disconnected: {reason}")

    def on_participant_disconnected(participant: rtc.RemoteParticipant) -> None:
        if agent_identity is not None and participant.identity == agent_identity:
            finish(f"agent {agent_identity} left")

    room.on("disconnected", on_disconnected)
    room.on("participant_disconnected", on_participant_disconnected)
    try:
        await runner.start()
        complete = asyncio.ensure_future(runner.wait_for_complete())
        complete.add_done_callback(lambda _: finish("the avatar runner finished"))
        return await gone
    finally:
        room.off("disconnected", on_disconnected)
        room.off("participant_disconnected", on_participant_disconnected)
        await runner.aclose()
        await session.stop("livekit avatar stopped")


async def run(url: str, token: str, room_name: str, preset: str, agent_identity: str | None) -> None:
    room = rtc.Room()
    await room.connect(url, token)
    try:
        reason = await serve(room, DataStreamAudioReceiver(room), PipelineConfig(preset=preset), room_name,
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
