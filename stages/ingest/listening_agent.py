"""The built-in voice agent: it hears the user's microphone, recognises what was said offline,
answers by a few honest rules and speaks with espeak-ng (``IngestConfig.adapter = "listening"``).

    ingest's VAD ─► notify(USER_SPEECH_START) ─► the recogniser opens an utterance (with ~0.5 s of
                                                 the audio before the start, which the VAD needed
                                                 to be sure)
    hear(frame) ──► decoded while the user speaks (stages.ingest.asr, pocketsphinx)
    ingest's VAD ─► notify(USER_SPEECH_END)   ─► the transcript is final → reply_policy.reply →
                                                 espeak-ng, sentence by sentence → AgentTurnStart
                                                 (with what was heard and answered), 20 ms
                                                 AgentAudioFrames, AgentTurnEnd

It implements the same adapter interface as every other agent (``stages.ingest.adapters``), so
``--adapter zmq|pipecat|livekit`` swaps in a real one. Decoder work runs on one worker thread at a
time (``CapacityLimiter(1)``), in the order ingest delivered the audio, off the event loop. A
barge-in (``interrupt``) or new user speech stops the reply being streamed.
"""

from __future__ import annotations

import re
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

import anyio
import numpy as np
from charstream.stages.config import IngestConfig
from charstream.stages.ingest.adapters import (
    AgentAudioFrame,
    AgentEvent,
    AgentTurnEnd,
    AgentTurnStart,
    TurnRef,
    UserAudioFrame,
)
from charstream.stages.ingest.asr import SpeechRecognizer, Transcript
from charstream.stages.ingest.reply_policy import reply
from charstream.stages.ingest.tts import synthesize
from charstream.transport.messages import TurnEvent, TurnKind

PREROLL_S = 0.5  # audio kept before the VAD's start: its decision comes ~100 ms after the onset
FRAME_S = 0.02
PENDING_UTTERANCES = 4  # ended utterances waiting for their answer (bounded)
KEEP_TURNS = 64  # what was heard and answered, for tests and reports (bounded)


@dataclass
class HeardTurn:
    turn_id: int  # ingest's turn id (from the USER_SPEECH_END it answers)
    heard: str  # the recogniser's transcript
    answer: str  # what the agent said
    speech_end_at: float  # the VAD's (back-dated) end of speech, wall clock
    transcript_at: float  # wall clock when the transcript was final
    finalize_s: float  # the recogniser's last search, after the end of speech was detected


def sentences(text: str) -> list[str]:
    """``text`` split after each sentence's punctuation (espeak speaks each as it is synthesised)."""
    return [s for s in re.split(r"(?<=[.!?])\s+", text.strip()) if s]


class ListeningAgent:
    name = "listening"

    def __init__(self, config: IngestConfig | None = None, session_id: str = "") -> None:
        self.config = config or IngestConfig()
        self.session_id = session_id
        self._recogniser: SpeechRecognizer | None = None
        self._worker = anyio.CapacityLimiter(1)  # the recogniser is not thread-safe: one call at a time, in order
        self._preroll: deque[np.ndarray] = deque()
        self._preroll_samples = 0
        self._rate = 48_000
        self._listening = False  # between the VAD's start and end of the user's speech
        self._utterance = 0  # counts started utterances: a reply stops when a newer one starts
        self._ended, self._pending = anyio.create_memory_object_stream[tuple[TurnEvent, int]](PENDING_UTTERANCES)
        self._interrupted: set[TurnRef] = set()
        self.turns: deque[HeardTurn] = deque(maxlen=KEEP_TURNS)

    async def start(self) -> None:
        def load() -> SpeechRecognizer:
            synthesize("ready", self.config.agent_voice)  # espeak's first call loads its voices: not in a turn
            return SpeechRecognizer(self.config.asr_language_model, self._rate)

        self._recogniser = await anyio.to_thread.run_sync(load)

    # --- the user's side: audio and the VAD's decisions, from ingest -------------------------------

    async def hear(self, frame: UserAudioFrame) -> None:
        if frame.sample_rate != self._rate:
            raise ValueError(f"the built-in agent hears {self._rate} Hz audio, got {frame.sample_rate} Hz")
        if self._listening:
            await anyio.to_thread.run_sync(self._recogniser.feed, frame.samples, limiter=self._worker)
            return
        self._preroll.append(frame.samples)
        self._preroll_samples += len(frame.samples)
        while self._preroll_samples - len(self._preroll[0]) >= PREROLL_S * self._rate:
            self._preroll_samples -= len(self._preroll.popleft())

    async def notify(self, event: TurnEvent) -> None:
        if event.kind == TurnKind.USER_SPEECH_START and not self._listening:
            self._listening = True
            self._utterance += 1
            preroll = np.concatenate(self._preroll) if self._preroll else np.zeros(0, np.int16)
            self._preroll.clear()
            self._preroll_samples = 0

            def begin() -> None:
                self._recogniser.begin()
                self._recogniser.feed(preroll)

            await anyio.to_thread.run_sync(begin, limiter=self._worker)
        elif event.kind == TurnKind.USER_SPEECH_END and self._listening:
            self._listening = False
            try:
                self._ended.send_nowait((event, self._utterance))
            except anyio.WouldBlock:  # answers are this far behind: this utterance goes unanswered
                await anyio.to_thread.run_sync(self._recogniser.end, limiter=self._worker)

    async def interrupt(self, turn_ref: TurnRef) -> None:
        self._interrupted.add(turn_ref)

    # --- the agent's side: answers, as events for ingest ---------------------------------------

    async def events(self) -> AsyncIterator[AgentEvent]:
        async with self._pending:
            async for event, utterance in self._pending:
                transcript: Transcript = await anyio.to_thread.run_sync(self._recogniser.end, limiter=self._worker)
                answer = reply(transcript.text)
                turn = HeardTurn(event.turn_id, transcript.text, answer, event.at, time.time(), transcript.finalize_s)
                self.turns.append(turn)
                if self._utterance != utterance:  # the user spoke again before the answer began
                    continue
                async for agent_event in self._speak(turn, utterance):
                    yield agent_event

    async def _speak(self, turn: HeardTurn, utterance: int) -> AsyncIterator[AgentEvent]:
        ref = turn.turn_id
        yield AgentTurnStart(ref, heard=turn.heard, answer=turn.answer)
        for sentence in sentences(turn.answer):
            speech = await anyio.to_thread.run_sync(synthesize, sentence, self.config.agent_voice)
            step = int(round(speech.sample_rate * FRAME_S))
            for i in range(0, len(speech.samples), step):
                if ref in self._interrupted or self._utterance != utterance:
                    self._interrupted.discard(ref)
                    yield AgentTurnEnd(ref, "interrupted")
                    return
                yield AgentAudioFrame(speech.samples[i:i + step], speech.sample_rate, turn_ref=ref)
        yield AgentTurnEnd(ref)

    async def close(self) -> None:
        await self._ended.aclose()
