"""charstream as a LiveKit Agents avatar (optional extra ``livekit``).

``CharstreamVideoGenerator`` implements LiveKit's ``VideoGenerator`` so that LiveKit's
``AvatarRunner`` publishes the character in a room:

    session = EmbeddedSession(config, room_name)        # ingest.adapter = "livekit"
    await session.start()
    runner = AvatarRunner(room, audio_recv=DataStreamAudioReceiver(room), video_gen=CharstreamVideoGenerator(session),
                          options=AvatarOptions(video_width=W, video_height=H, video_fps=24,
                                                audio_sample_rate=48000, audio_channels=1))

The runner does LiveKit's playback bookkeeping from what the generator yields: every
``rtc.AudioFrame`` adds to the playback position (the agent cuts its transcript there when the
user interrupts), the first one of a segment is ``playback_started``, ``AudioSegmentEnd`` is
``playback_finished``. So the generator yields:

- an ``rtc.VideoFrame`` (RGB24) for every 24 fps frame playout releases;
- an ``rtc.AudioFrame`` (48 kHz mono, 2,000 samples: that frame's own audio) only for the frames
  that play a segment's speech: from its first voiced frame through the frame that holds the last
  sound the agent pushed (pauses inside the speech included; the listening frames around it, and
  exact zeros the TTS put before or after it, not), so the position is the speech's duration,
  rounded up to whole frames;
- ``AudioSegmentEnd`` right after that frame, once the agent has ended the segment.

``push_audio(rtc.AudioFrame)`` → the agent's speech (any rate; ingest resamples); the first frame of
a segment starts a turn, ``AudioSegmentEnd`` ends it. ``clear_buffer()`` (the user interrupted) →
barge-in: from that moment no more of the segment counts as played (the runner reports the
interrupted position as what was heard), queued speech is dropped and charstream returns to
listening within one chunk.

``serve_avatar(room, audio_recv, config, session_id)`` is the avatar participant's whole job (the
runner, the generator, the session) until the room or the agent goes; ``livekit_plugin`` starts it
from the agent's side.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np
from livekit import rtc
from livekit.agents.voice.avatar import (
    AudioReceiver,
    AudioSegmentEnd,
    AvatarOptions,
    AvatarRunner,
    VideoGenerator,
)

from charstream.model.config import get_preset
from charstream.pipeline.config import PipelineConfig
from charstream.pipeline.integrations.embedded import EmbeddedSession
from charstream.stages.ingest.adapters import AgentAudioFrame, AgentTurnEnd, AgentTurnStart
from charstream.stages.playout.output import ReleasedFrame
from charstream.timeline import TIMELINE_RATE, VIDEO_FPS
from charstream.transport.messages import TurnKind

CLEAR_WAIT_S = 1.0  # at most this long for the runner to count a frame in flight (it pushes at 24 fps)


@dataclass
class _Segment:
    """One segment of the agent's speech: how much was pushed, how much has played."""

    pushed_s: float = 0.0
    first_voiced_s: float | None = None  # the first and last sound pushed (not exact zero), in seconds
    last_voiced_s: float = 0.0
    ended: bool = False  # the agent sent AudioSegmentEnd
    played_s: float = 0.0  # frames yielded with audio
    onset_s: float = 0.0  # where the sound starts in its first frame
    turn_id: int | None = None  # charstream's turn, known once its first frame plays

    def push(self, samples: np.ndarray, rate: int, channels: int) -> None:
        voiced = np.flatnonzero(samples) // channels
        if len(voiced):
            if self.first_voiced_s is None:
                self.first_voiced_s = self.pushed_s + voiced[0] / rate
            self.last_voiced_s = self.pushed_s + (voiced[-1] + 1) / rate
        self.pushed_s += len(samples) // channels / rate

    @property
    def heard(self) -> bool:
        """All the pushed sound has played: the frames yielded cover it, from its onset on."""
        voiced_s = self.last_voiced_s - (self.first_voiced_s or 0.0)
        return self.played_s >= self.onset_s + voiced_s - 1e-9


class CharstreamVideoGenerator(VideoGenerator):
    def __init__(self, session: EmbeddedSession) -> None:
        self._session = session
        self._pushing: _Segment | None = None  # the segment the agent is pushing
        self._turns = 0  # segments started (each is a charstream agent turn)
        self._queued: deque[_Segment] = deque()  # pushed, not yet heard (bounded by the adapter's queue)
        self._playing: _Segment | None = None
        self._last_turn = 0  # charstream turns at or below this are done (played out or cleared)
        self._counted = asyncio.Event()  # the runner has taken the last audio frame into its position
        self._counted.set()
        self.frames_out = 0

    async def push_audio(self, frame: rtc.AudioFrame | AudioSegmentEnd) -> None:
        adapter = self._session.adapter
        if isinstance(frame, AudioSegmentEnd):
            if self._pushing is not None:
                self._pushing.ended = True
                self._pushing = None
                await adapter.push(AgentTurnEnd(self._turns))
            return
        if self._pushing is None:
            self._pushing = _Segment()
            self._queued.append(self._pushing)
            self._turns += 1
            await adapter.push(AgentTurnStart(self._turns))
        samples = np.frombuffer(frame.data, dtype=np.int16)
        self._pushing.push(samples, frame.sample_rate, frame.num_channels)
        await adapter.push(AgentAudioFrame(samples, frame.sample_rate, frame.num_channels, self._turns))

    async def clear_buffer(self) -> None:
        # Before any await: the runner reads its playback position when this returns, so no frame
        # after this moment may count as played.
        if self._playing is not None and self._playing.turn_id is not None:
            self._last_turn = max(self._last_turn, self._playing.turn_id)
        self._playing, self._queued = None, deque()
        pushing, self._pushing = self._pushing, None
        # The runner adds a frame to its position after pushing it to the AV synchronizer: one handed
        # out just before the clear must be counted before the runner reports (and zeroes) the position.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._counted.wait(), CLEAR_WAIT_S)
        adapter = self._session.adapter
        await adapter.user_speech(TurnKind.USER_SPEECH_START, time.time(), interrupt=True)
        if pushing is not None:
            await adapter.push(AgentTurnEnd(self._turns, "interrupted"))

    def __aiter__(self) -> AsyncIterator[rtc.VideoFrame | rtc.AudioFrame | AudioSegmentEnd]:
        return self._frames()

    async def _frames(self) -> AsyncIterator[rtc.VideoFrame | rtc.AudioFrame | AudioSegmentEnd]:
        async for released in self._session.frames():
            if self._playing is None and self._queued and self._queued[0].ended and \
                    self._queued[0].first_voiced_s is None:  # a segment of exact silence: nothing to play
                self._queued.popleft()
                yield AudioSegmentEnd()
            height, width = released.image.shape[:2]
            yield rtc.VideoFrame(width, height, rtc.VideoBufferType.RGB24, released.image.tobytes())
            self.frames_out += 1
            if self._plays_speech(released):
                self._playing.played_s += 1 / VIDEO_FPS
                self._counted.clear()
                yield rtc.AudioFrame(released.audio.tobytes(), TIMELINE_RATE, 1, len(released.audio))
                self._counted.set()  # asked for the next item: the runner has counted this one
            segment = self._playing
            # ended early: a frame past its turn means ingest dropped some of it; it has played out
            if segment is not None and segment.ended and (segment.heard or (
                    released.chunk is not None and not self._of_turn(released, segment))):
                self._last_turn = max(self._last_turn, segment.turn_id)
                self._playing = None
                yield AudioSegmentEnd()

    def _plays_speech(self, released: ReleasedFrame) -> bool:
        """Whether this frame plays (part of) a segment's speech; the next segment starts at its
        first voiced frame."""
        if released.chunk is None:  # a hold frame (underrun): the speech is late, not playing
            return False
        segment = self._playing
        if segment is None:
            turn_id = released.trace.turn_id if released.trace is not None else None
            voiced = np.flatnonzero(released.audio)
            if not (self._queued and released.speaking and turn_id is not None and turn_id > self._last_turn
                    and len(voiced)):
                return False
            segment = self._playing = self._queued.popleft()
            segment.turn_id, segment.onset_s = turn_id, voiced[0] / TIMELINE_RATE
        return self._of_turn(released, segment) and not segment.heard

    @staticmethod
    def _of_turn(released: ReleasedFrame, segment: _Segment) -> bool:
        return released.speaking and released.trace is not None and released.trace.turn_id == segment.turn_id


async def serve_avatar(room: rtc.Room, audio_recv: AudioReceiver, config: PipelineConfig, session_id: str,
                       agent_identity: str | None = None) -> str:
    """Render the character in ``room`` until the room disconnects, ``agent_identity`` leaves, or the
    session ends (a room that goes while the session starts counts too); returns why it stopped."""
    config.ingest.adapter = "livekit"
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
    session = EmbeddedSession(config, session_id)
    runner: AvatarRunner | None = None
    try:
        starting = asyncio.ensure_future(session.start())
        await asyncio.wait({starting, gone}, return_when=asyncio.FIRST_COMPLETED)
        if gone.done():
            starting.cancel()
            return gone.result()
        starting.result()  # a session that failed to start raises here
        model = get_preset(config.preset)
        runner = AvatarRunner(
            room, audio_recv=audio_recv, video_gen=CharstreamVideoGenerator(session),
            options=AvatarOptions(video_width=model.width, video_height=model.height, video_fps=VIDEO_FPS,
                                  audio_sample_rate=TIMELINE_RATE, audio_channels=1),
        )
        await runner.start()
        complete = asyncio.ensure_future(runner.wait_for_complete())
        complete.add_done_callback(lambda _: finish("the avatar runner finished"))
        return await gone
    finally:
        room.off("disconnected", on_disconnected)
        room.off("participant_disconnected", on_participant_disconnected)
        if runner is not None:
            await runner.aclose()
        await session.stop("livekit avatar stopped")
