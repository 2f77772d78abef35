"""charstream as a Pipecat avatar service (optional extra ``pipecat``).

``CharstreamVideoService`` sits after the TTS in a Pipecat pipeline, in place of a hosted avatar
service (HeyGen, Tavus, Simli) and with their lifecycle: the charstream session (``EmbeddedSession``,
``ingest.adapter = "pipecat"``) starts with the pipeline's ``StartFrame`` and ends with its
``EndFrame`` / ``CancelFrame`` or cleanup; a session that fails to start, or dies, is a permanent
``ErrorFrame`` saying why, and the pipeline is cancelled (a silent avatar would make a mute bot).

- ``TTSStartedFrame`` / ``TTSAudioRawFrame`` / ``TTSStoppedFrame`` → the agent's turn and speech
  (any TTS rate: ingest resamples). The TTS audio is consumed: what the character says leaves, in
  sync with its face, as ``SpeechOutputAudioRawFrame`` (48 kHz mono, 2,000 samples per 24 fps frame)
  — the frame type Pipecat's output transport counts as bot speech, so it emits
  ``BotStartedSpeakingFrame`` / ``BotStoppedSpeakingFrame`` when the character's speech is heard.
- video: each frame's ``OutputImageRawFrame`` goes first, ``sync_with_audio`` set, so the transport
  shows it when the audio before it has been sent; image and audio carry the same ``pts`` (the
  frame's place on charstream's output timeline at the session's fps, on the pipeline clock).
- ``UserStartedSpeakingFrame`` / ``UserStoppedSpeakingFrame`` → the user's turn as Pipecat decided
  it; its end is back-dated by the VAD's ``stop_secs`` (``VADUserStoppedSpeakingFrame``), as
  Pipecat's ``UserBotLatencyObserver`` does. User speech alone interrupts nothing.
- ``InterruptionFrame`` (sent only when the pipeline's own strategies decide to interrupt) →
  barge-in: queued speech is dropped and the character returns to listening within one chunk.
- ``BotStartedSpeakingFrame`` coming back upstream from the output transport stamps the turn's
  ``client_first_speaking_frame``: embedded turns complete, with delivery and total.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
from pipecat.frames.frames import (
    BotStartedSpeakingFrame,
    CancelFrame,
    CancelWorkerFrame,
    EndFrame,
    Frame,
    InterruptionFrame,
    OutputImageRawFrame,
    SpeechOutputAudioRawFrame,
    StartFrame,
    TTSAudioRawFrame,
    TTSStartedFrame,
    TTSStoppedFrame,
    UserStartedSpeakingFrame,
    UserStoppedSpeakingFrame,
    VADUserStoppedSpeakingFrame,
)
from pipecat.processors.frame_processor import FrameDirection
from pipecat.services.ai_service import AIService
from pipecat.services.settings import ServiceSettings

from charstream.pipeline.integrations.embedded import EmbeddedSession
from charstream.stages.ingest.adapters import AgentAudioFrame, AgentTurnEnd, AgentTurnStart
from charstream.timeline import TIMELINE_RATE
from charstream.transport.messages import TurnKind


class CharstreamVideoService(AIService):
    def __init__(self, session: EmbeddedSession, **kwargs) -> None:
        super().__init__(settings=ServiceSettings(model=None), **kwargs)  # no model to name
        self._session = session
        self._turn = 0  # the agent turn in progress (0: none)
        self._turns = 0
        self._user_stopped_at: float | None = None  # the last VAD stop, back-dated by its stop_secs
        self._undelivered: int | None = None  # the turn whose first speaking frame went out, not yet heard
        self._video_task: asyncio.Task | None = None
        self._stopping = False
        self._pts0: int | None = None  # pipeline-clock ns of output frame 0
        self.frames_out = 0  # video frames pushed downstream

    def can_generate_metrics(self) -> bool:
        return True

    async def start(self, frame: StartFrame) -> None:
        await super().start(frame)
        self._video_task = self.create_task(self._run_session())

    async def stop(self, frame: EndFrame) -> None:
        await super().stop(frame)
        await self._teardown("pipecat pipeline ended")

    async def cancel(self, frame: CancelFrame) -> None:
        await super().cancel(frame)
        await self._teardown("pipecat pipeline cancelled")

    async def cleanup(self) -> None:
        await super().cleanup()
        await self._teardown("pipecat pipeline cleaned up")

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)  # StartFrame / EndFrame / CancelFrame: the lifecycle
        adapter = self._session.adapter
        if isinstance(frame, TTSStartedFrame):
            await self.start_ttfb_metrics()  # stopped when the transport sends the character's speech
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
        elif isinstance(frame, InterruptionFrame):
            await adapter.user_speech(TurnKind.USER_SPEECH_START, time.time(), interrupt=True)
            if self._turn:
                await adapter.push(AgentTurnEnd(self._turn, "interrupted"))
                self._turn = 0
            await self.push_frame(frame, direction)
        elif isinstance(frame, UserStartedSpeakingFrame):
            await adapter.user_speech(TurnKind.USER_SPEECH_START, time.time())
            await self.push_frame(frame, direction)
        elif isinstance(frame, VADUserStoppedSpeakingFrame):
            self._user_stopped_at = frame.timestamp - frame.stop_secs
            await self.push_frame(frame, direction)
        elif isinstance(frame, UserStoppedSpeakingFrame):
            at, self._user_stopped_at = self._user_stopped_at or time.time(), None
            await adapter.user_speech(TurnKind.USER_SPEECH_END, at)
            await self.push_frame(frame, direction)
        elif isinstance(frame, BotStartedSpeakingFrame) and direction == FrameDirection.UPSTREAM:
            await self.stop_ttfb_metrics()
            if self._undelivered is not None:  # the output transport is sending the turn's first speech
                self._session.delivered(self._undelivered, time.time())
                self._undelivered = None
            await self.push_frame(frame, direction)
        else:
            await self.push_frame(frame, direction)

    async def _start_turn(self) -> None:
        if self._turn:
            await self._session.adapter.push(AgentTurnEnd(self._turn))
        self._turns += 1
        self._turn = self._turns
        await self._session.adapter.push(AgentTurnStart(self._turn))

    async def _run_session(self) -> None:
        """Start the session, then push every frame playout releases, with its own audio, at the
        24 fps pace of playout's clock; a session that fails or ends early cancels the pipeline."""
        try:
            await self._session.start()
            async for released in self._session.frames():
                await self._push_released(released)
            result = await self._session.stop("its frames ended")
            problem = f"the charstream session ended: {result.error or result.ended_by}"
        except Exception as e:  # noqa: BLE001 (every failure is reported, none is silent)
            problem = str(e)
        if self._stopping:  # the pipeline is ending it
            return
        await self.push_error(problem, force_treat_as_permanent=True)
        await self.push_frame(CancelWorkerFrame(reason=problem), FrameDirection.UPSTREAM)

    async def _push_released(self, released) -> None:
        fps = self._session.timeline.fps
        if self._pts0 is None:
            self._pts0 = self.get_clock().get_time() - released.index * 1_000_000_000 // fps
        pts = self._pts0 + released.index * 1_000_000_000 // fps
        height, width = released.image.shape[:2]
        image = OutputImageRawFrame(image=released.image.tobytes(), size=(width, height), format="RGB")
        image.sync_with_audio = True
        audio = SpeechOutputAudioRawFrame(audio=released.audio.tobytes(), sample_rate=TIMELINE_RATE, num_channels=1)
        image.pts = audio.pts = pts
        # where the pair sits on charstream's output timeline; chunk None = a hold frame (underrun)
        image.metadata["charstream"] = audio.metadata["charstream"] = {"index": released.index,
                                                                       "chunk": released.chunk}
        if released.first_speaking and released.trace is not None:
            self._undelivered = released.trace.turn_id
        await self.push_frame(image)
        await self.push_frame(audio)
        self.frames_out += 1

    async def _teardown(self, reason: str) -> None:
        """Idempotent: end the session, then the task that forwards its frames."""
        task, self._video_task = self._video_task, None
        if task is None:
            return
        self._stopping = True
        await self._session.stop(reason)
        await self.cancel_task(task)
