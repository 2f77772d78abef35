"""The agent's side of charstream in LiveKit Agents (optional extra ``livekit``), in the pattern of
LiveKit's avatar plugins (Tavus, Hedra, Bey): an ``AvatarSession`` that brings the avatar
participant into the room and points the agent's audio at it.

    avatar = AvatarSession(config=PipelineConfig())
    await avatar.start(session, room=ctx.room)         # before session.start(...)
    await session.start(agent=MyAgent(), room=ctx.room)

Where a hosted plugin asks its service to join, this one runs the avatar participant in the
agent's process: a second room connection as ``avatar_participant_identity`` (publishing on the
agent's behalf), serving the character with ``livekit.serve_avatar`` until the room or the agent
goes. The agent's ``session.output.audio`` becomes a ``DataStreamAudioOutput`` to it, so the agent's
TTS reaches charstream, and LiveKit's playback events and transcript sync come back from it.
"""

from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING

from livekit import api, rtc
from livekit.agents.types import ATTRIBUTE_PUBLISH_ON_BEHALF
from livekit.agents.voice.avatar import AvatarSession as LiveKitAvatarSession
from livekit.agents.voice.avatar import DataStreamAudioOutput, DataStreamAudioReceiver

from charstream.pipeline.config import PipelineConfig
from charstream.pipeline.integrations.livekit import serve_avatar

if TYPE_CHECKING:
    from livekit.agents import AgentSession

WORKER_STOP_S = 10.0  # for the avatar worker to end its session once its room has disconnected


class AvatarSession(LiveKitAvatarSession):
    """charstream's avatar in a LiveKit room, started from the agent."""

    def __init__(self, *, config: PipelineConfig | None = None,
                 avatar_participant_identity: str = "charstream-avatar",
                 avatar_participant_name: str = "charstream") -> None:
        super().__init__()
        self._config = config or PipelineConfig()
        self._identity = avatar_participant_identity
        self._name = avatar_participant_name
        self._avatar_room: rtc.Room | None = None
        self._worker: asyncio.Task[str] | None = None

    @property
    def avatar_identity(self) -> str:
        return self._identity

    @property
    def provider(self) -> str:
        return "charstream"

    def token(self, room: rtc.Room, api_key: str, api_secret: str) -> str:
        """The avatar participant's token: joins ``room``, publishes on behalf of the agent."""
        return (api.AccessToken(api_key, api_secret).with_kind("agent").with_identity(self._identity)
                .with_name(self._name).with_grants(api.VideoGrants(room_join=True, room=room.name))
                .with_attributes({ATTRIBUTE_PUBLISH_ON_BEHALF: room.local_participant.identity}).to_jwt())

    async def start(self, agent_session: AgentSession, room: rtc.Room, *, livekit_url: str | None = None,
                    livekit_api_key: str | None = None, livekit_api_secret: str | None = None) -> None:
        url = livekit_url or os.environ.get("LIVEKIT_URL")
        key = livekit_api_key or os.environ.get("LIVEKIT_API_KEY")
        secret = livekit_api_secret or os.environ.get("LIVEKIT_API_SECRET")
        if not (url and key and secret):
            raise ValueError("the charstream avatar joins the room itself: it needs livekit_url, livekit_api_key "
                             "and livekit_api_secret (or LIVEKIT_URL, LIVEKIT_API_KEY, LIVEKIT_API_SECRET)")
        await super().start(agent_session, room)
        avatar_room = rtc.Room()
        try:
            await avatar_room.connect(url, self.token(room, key, secret))
        except Exception as e:
            raise RuntimeError(f"the charstream avatar could not join room {room.name!r} at {url}: {e}") from e
        self._avatar_room = avatar_room
        agent = room.local_participant.identity
        self._worker = asyncio.create_task(serve_avatar(
            avatar_room, DataStreamAudioReceiver(avatar_room, sender_identity=agent), self._config,
            f"{room.name}-{self._identity}", agent_identity=agent))
        agent_session.output.audio = DataStreamAudioOutput(
            room, destination_identity=self._identity, wait_remote_track=rtc.TrackKind.KIND_VIDEO)

    async def aclose(self) -> None:
        if self._avatar_room is not None:
            await self._avatar_room.disconnect()  # serve_avatar returns: the room disconnected
            self._avatar_room = None
        if self._worker is not None:
            done, _ = await asyncio.wait({self._worker}, timeout=WORKER_STOP_S)
            if not done:  # the room never said it disconnected
                self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)
            self._worker = None
        await super().aclose()
