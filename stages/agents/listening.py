"""The built-in voice agent: it hears the user's microphone, recognises what was said offline,
answers by a few honest rules and speaks with espeak-ng (``IngestConfig.adapter = "listening"``).

    hear(frame) ──────────────► decoded while the user speaks (stages.agents.moonshine, offline)
    notify(USER_SPEECH_START) ► the utterance opens (with the pre-roll the VAD needed)
    notify(USER_SPEECH_END)   ► the transcript is final → reply_policy.reply → espeak-ng, sentence
                                by sentence → AgentTurnStart (with what was heard and answered),
                                20 ms AgentAudioFrames, AgentTurnEnd

It implements the same adapter interface as every other agent (``stages.ingest.adapters``), so
``--adapter zmq|pipecat|livekit`` swaps in a real one. A barge-in (``interrupt``) or new user
speech stops the reply being streamed.
"""

from __future__ import annotations

import re
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

import anyio

from charstream.stages.agents.asr import TurnRecognizer
from charstream.stages.agents.reply_policy import reply
from charstream.stages.agents.tts import Speech, synthesize
from charstream.stages.config import IngestConfig
from charstream.stages.ingest.adapters import (
    AgentAudioFrame,
    AgentEvent,
    AgentTurnEnd,
    AgentTurnStart,
    TurnRef,
    UserAudioFrame,
)
from charstream.transport.messages import TurnEvent, TurnKind

FRAME_S = 0.02
PENDING_TURNS = 4  # heard utterances waiting for their answer (bounded)
KEEP_TURNS = 64  # what was heard and answered, for tests and reports (bounded)


@dataclass
class HeardTurn:
    turn_id: int  # ingest's turn id (from the USER_SPEECH_END it answers)
    heard: str  # the recogniser's transcript
    answer: str  # what the agent says
    speech_end_at: float  # the user's end of speech (as ingest dated it), wall clock
    transcript_at: float  # wall clock when the transcript was final
    finalize_s: float  # the recogniser's last search, after the VAD decided


def sentences(text: str) -> list[str]:
    """``text`` split after each sentence's punctuation (each is synthesised as the previous plays)."""
    return [s for s in re.split(r"(?<=[.!?])\s+", text.strip()) if s]


class ListeningAgent:
    name = "listening"

    def __init__(self, config: IngestConfig | None = None, session_id: str = "") -> None:
        self.config = config or IngestConfig()
        self.session_id = session_id
        self._ears: TurnRecognizer | None = None
        self._utterance = 0  # counts started utterances: a reply stops when a newer one starts
        self._heard, self._pending = anyio.create_memory_object_stream[tuple[HeardTurn, int]](PENDING_TURNS)
        self._interrupted: set[TurnRef] = set()
        self.turns: deque[HeardTurn] = deque(maxlen=KEEP_TURNS)
        self.unanswered = 0  # utterances dropped because PENDING_TURNS were already waiting
        self._ready: tuple[str, Speech] | None = None  # the answer's first sentence, spoken in the pause
        self.ready_used = 0  # answers whose first sentence was ready when the turn ended

    async def start(self) -> None:
        # espeak's first call loads its voice data: done now, not in the first turn
        await anyio.to_thread.run_sync(synthesize, "ready", self.config.agent_voice)
        self._ears = await TurnRecognizer.load(self.config.recognizer)
        if hasattr(self._ears.recogniser, "on_guess"):
            self._ears.recogniser.on_guess = self._prepare

    def _prepare(self, guess: str) -> None:
        """The recogniser's guess at the transcript, made in a pause before the VAD ends the turn
        (its worker thread): the answer's first sentence is synthesised now, so if the guess stands
        its audio is ready when the turn ends."""
        first = sentences(reply(guess))[0]
        if self._ready is not None and self._ready[0] == first:
            return
        try:
            self._ready = (first, synthesize(first, self.config.agent_voice))
        except Exception:  # noqa: BLE001 - only a head start: _speak synthesises it again and reports
            self._ready = None

    async def hear(self, frame: UserAudioFrame) -> None:
        await self._ears.hear(frame.samples)

    async def notify(self, event: TurnEvent) -> None:
        if event.kind == TurnKind.USER_SPEECH_START and not self._ears.listening:
            self._utterance += 1
            await self._ears.speech_started()
        elif event.kind == TurnKind.USER_SPEECH_END:
            transcript = await self._ears.speech_ended()
            if transcript is None:
                return
            turn = HeardTurn(event.turn_id, transcript.text, reply(transcript.text), event.at, time.time(),
                             transcript.finalize_s)
            self.turns.append(turn)
            try:
                self._heard.send_nowait((turn, self._utterance))
            except anyio.WouldBlock:  # answers are this far behind: this one is skipped (counted)
                self.unanswered += 1

    async def interrupt(self, turn_ref: TurnRef) -> None:
        self._interrupted.add(turn_ref)

    async def events(self) -> AsyncIterator[AgentEvent]:
        async with self._pending:
            async for turn, utterance in self._pending:
                if self._utterance == utterance:  # else the user spoke again before the answer began
                    async for event in self._speak(turn, utterance):
                        yield event

    async def _speak(self, turn: HeardTurn, utterance: int) -> AsyncIterator[AgentEvent]:
        ref = turn.turn_id
        yield AgentTurnStart(ref, heard=turn.heard, answer=turn.answer)
        for sentence in sentences(turn.answer):
            ready = self._ready
            if ready is not None and ready[0] == sentence:
                speech, self._ready = ready[1], None
                self.ready_used += 1
            else:
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
        await self._heard.aclose()
        if self._ears is not None:
            await self._ears.close()
