"""charstream as a LiveKit Agents avatar (optional extra ``livekit``).

``CharstreamVideoGenerator`` implements LiveKit's ``VideoGenerator`` so that LiveKit's
``AvatarRunner`` can publish the character in a room:

    session = AvatarSession(graph, config, room_name)        # ingest.adapter = "livekit"
    await session.start()
    runner = AvatarRunner(room, audio_recv=DataStreamAudioReceiver(room), video_gen=CharstreamVideoGenerator(session),
                          options=AvatarOptions(video_width=W, video_height=H, video_fps=24,
                                                audio_sample_rate=48000, audio_channels=1))

- ``push_audio(rtc.AudioFrame)`` → the agent's speech (any rate; ingest resamples); the first frame
  of a segment starts a turn, ``AudioSegmentEnd`` ends it.
- ``clear_buffer()`` (the agent was interrupted) → barge-in: queued speech is dropped and charstream
  returns to listening within one chunk.
- iteration yields, per 24 fps frame that playout releases, an ``rtc.VideoFrame`` (RGB24) and the
  ``rtc.AudioFrame`` (48 kHz mono, 2,000 samples) that belongs to it; once a segment has ended and
  its speech has played out (heard, then ``SEGMENT_END_SILENT_FRAMES`` frames of exact silence), an
  ``AudioSegmentEnd``, so the runner reports playback finished.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import numpy as np
from charstream.pipeline.integrations.avatar_session import AvatarSession
from charstream.stages.ingest.adapters import AgentAudioFrame, AgentTurnEnd, AgentTurnStart
from charstream.transport.messages import TurnKind
from livekit import rtc
from livekit.agents.voice.avatar import AudioSegmentEnd, VideoGenerator

from charstream.timeline import TIMELINE_RATE

# Listening chunks carry exact digital silence; this many silent frames after a segment's end
# means its speech has left playout (speech itself has no 333 ms of exact zeros).
SEGMENT_END_SILENT_FRAMES = 8


class CharstreamVideoGenerator(VideoGenerator):
    def __init__(self, session: AvatarSession) -> None:
        self._session = session
        self._turn = 0  # the segment being pushed (0: none)
        self._turns = 0
        self._segment_ended = False  # a segment ended; AudioSegmentEnd not yet yielded
        self._segment_heard = False  # speech of the current/ended segment has come out of playout
        self.frames_out = 0

    async def push_audio(self, frame: rtc.AudioFrame | AudioSegmentEnd) -> None:
        adapter = self._session.adapter
        if isinstance(frame, AudioSegmentEnd):
            if self._turn:
                await adapter.push(AgentTurnEnd(self._turn))
                self._turn, self._segment_ended = 0, True
            return
        if not self._turn:
            self._turns += 1
            self._turn, self._segment_heard = self._turns, False
            await adapter.push(AgentTurnStart(self._turn))
        samples = np.frombuffer(frame.data, dtype=np.int16)
        await adapter.push(AgentAudioFrame(samples, frame.sample_rate, frame.num_channels, self._turn))

    async def clear_buffer(self) -> None:
        adapter = self._session.adapter
        # LiveKit clears the buffer when the user interrupts the agent
        await adapter.user_speech(TurnKind.USER_SPEECH_START, time.time(), interrupt=True)
        if self._turn:
            await adapter.push(AgentTurnEnd(self._turn, "interrupted"))
            self._turn = 0
        self._segment_ended = False  # the runner reports the interrupted playback itself

    def __aiter__(self) -> AsyncIterator[rtc.VideoFrame | rtc.AudioFrame | AudioSegmentEnd]:
        return self._frames()

    async def _frames(self) -> AsyncIterator[rtc.VideoFrame | rtc.AudioFrame | AudioSegmentEnd]:
        silent = 0
        async for released in self._session.frames():
            height, width = released.image.shape[:2]
            yield rtc.VideoFrame(width, height, rtc.VideoBufferType.RGB24, released.image.tobytes())
            yield rtc.AudioFrame(released.audio.tobytes(), TIMELINE_RATE, 1, len(released.audio))
            self.frames_out += 1
            if released.audio.any():
                silent, self._segment_heard = 0, True
            elif released.chunk is not None:  # a hold frame (underrun) is a pause, not the end
                silent += 1
            if self._segment_ended and self._segment_heard and silent >= SEGMENT_END_SILENT_FRAMES:
                self._segment_ended = False
                yield AudioSegmentEnd()
