"""charstream as a Pipecat avatar service (optional extra ``pipecat``).

``CharstreamVideoService`` sits after the TTS in a Pipecat pipeline, in the style of Pipecat's avatar
services (Simli, HeyGen, Tavus): it consumes the TTS audio, and emits the character's video frames
(``OutputImageRawFrame``) together with the audio that belongs to each frame
(``OutputAudioRawFrame``, 48 kHz mono, 2,000 samples per 24 fps frame), in sync by construction —
both come out of charstream's playout in one piece. Behind it runs a charstream session
(``AvatarSession``: the session graph with ``ingest.adapter = "pipecat"``) in the same process.

- ``TTSStartedFrame`` / ``TTSAudioRawFrame`` / ``TTSStoppedFrame`` → the agent's turn and speech
  (any TTS rate: ingest resamples). The TTS audio is consumed, not forwarded: the synchronised
  copy leaves with the video.
- ``UserStartedSpeakingFrame`` / ``UserStoppedSpeakingFrame`` → the user's turn, as Pipecat's own
  VAD decided it (the stop is back-dated by ``user_stop_secs``, Pipecat's VAD ``stop_secs``).
- ``InterruptionFrame`` → barge-in: queued speech is dropped, charstream interrupts the turn and
  the character returns to listening within one chunk.
"""

from __future__ import annotations

import time

import numpy as np
from charstream.pipeline.integrations.avatar_session import AvatarSession
from charstream.stages.ingest.adapters import AgentAudioFrame, AgentTurnEnd, AgentTurnStart
from charstream.transport.messages import TurnKind
from pipecat.frames.frames import (
    CancelFrame,
    EndFrame,
    Frame,
    InterruptionFrame,
    OutputAudioRawFrame,
    OutputImageRawFrame,
    StartFrame,
    TTSAudioRawFrame,
    TTSStartedFrame,
    TTSStoppedFrame,
    UserStartedSpeakingFrame,
    UserStoppedSpeakingFrame,
)
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor

from charstream.timeline import TIMELINE_RATE


class CharstreamVideoService(FrameProcessor):
    def __init__(self, session: AvatarSession, *, user_stop_secs: float = 0.2, **kwargs) -> None:
        super().__init__(**kwargs)
        self._session = session
        self._user_stop_secs = user_stop_secs
        self._turn = 0  # the agent turn in progress (0: none)
        self._turns = 0
        self._video_task = None
        self.frames_out = 0  # video frames pushed downstream

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        adapter = self._session.adapter
        if isinstance(frame, StartFrame):
            await self.push_frame(frame, direction)
            await self._session.start()
            self._video_task = self.create_task(self._forward_video())
        elif isinstance(frame, TTSStartedFrame):
            await self._start_turn()
            await self.push_frame(frame, direction)
        elif isinstance(frame, TTSAudioRawFrame):
            if not self._turn:
                await self._start_turn()
            samples = np.frombuffer(frame.audio, dtype=np.int16)
            await adapter.push(AgentAudioFrame(samples, frame.sample_rate, frame.num_channels, self._turn))
        elif isinstance(frame, TTSStoppedFrame):
            if self._turn:
                await adapter.push(AgentTurnEnd(self._turn))
                self._turn = 0
            await self.push_frame(frame, direction)
        elif isinstance(frame, (InterruptionFrame, UserStartedSpeakingFrame)):
            # both mean the user is speaking now; an InterruptionFrame says the bot was interrupted
            await adapter.user_speech(TurnKind.USER_SPEECH_START, time.time(), isinstance(frame, InterruptionFrame))
            if self._turn:
                await adapter.push(AgentTurnEnd(self._turn, "interrupted"))
                self._turn = 0
            await self.push_frame(frame, direction)
        elif isinstance(frame, UserStoppedSpeakingFrame):
            await adapter.user_speech(TurnKind.USER_SPEECH_END, time.time() - self._user_stop_secs)
            await self.push_frame(frame, direction)
        elif isinstance(frame, (EndFrame, CancelFrame)):
            await self._stop()
            await self.push_frame(frame, direction)
        else:
            await self.push_frame(frame, direction)

    async def _start_turn(self) -> None:
        if self._turn:
            await self._session.adapter.push(AgentTurnEnd(self._turn))
        self._turns += 1
        self._turn = self._turns
        await self._session.adapter.push(AgentTurnStart(self._turn))

    async def _forward_video(self) -> None:
        """Every frame playout releases, with its own audio, at the 24 fps pace of playout's clock."""
        async for released in self._session.frames():
            height, width = released.image.shape[:2]
            image = OutputImageRawFrame(image=released.image.tobytes(), size=(width, height), format="RGB")
            audio = OutputAudioRawFrame(audio=released.audio.tobytes(), sample_rate=TIMELINE_RATE, num_channels=1)
            # where the pair sits on charstream's output timeline; chunk None = a hold frame (underrun)
            image.metadata["charstream"] = audio.metadata["charstream"] = {"index": released.index,
                                                                           "chunk": released.chunk}
            await self.push_frame(image)
            await self.push_frame(audio)
            self.frames_out += 1

    async def _stop(self) -> None:
        await self._session.stop("pipecat pipeline ended")
        if self._video_task is not None:
            await self.cancel_task(self._video_task)
            self._video_task = None
