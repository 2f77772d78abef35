"""The built-in scripted agent: a conversation played for real, with espeak-ng voices and silero-vad.

Each script line is a user utterance and the character's reply. Both are synthesised with espeak-ng
(``stages.agents.tts``): the user in ``IngestConfig.user_voice``, the character in ``agent_voice``.
The agent runs one 20 ms tick at real-time pace and, per tick, yields the simulated user's
microphone (48 kHz, speech or silence: ingest's VAD listens to it) and, while replying, one frame of
the reply at espeak's own 22,050 Hz (ingest resamples it, as for any agent): what its clock has
reached and the next 20 ms (``agent_pace = "realtime"``; a tick that runs late sends what came due),
or, as a TTS service pushes audio, all that ingest takes -- up to its ``max_ahead_s`` ahead of real
time (``"synthesized"``: espeak makes the whole line at once, so the first frame holds 0.25 s --
ingest's horizon: one chunk where chunks are longer -- each later one 20 ms).

A turn: the user speaks → ingest's VAD detects the end of speech and ``notify``s the agent →
the agent "thinks" for ``think_delay_s`` (standing for an LLM) → it streams the reply. The user's
speech also goes through the built-in agent's recogniser (``stages.agents.asr``), as ingest hands
it over (``hear``) and the VAD cuts it, so each turn's trace says what was really recognised
(the reply is the script's, whatever was heard). So the end
of speech is detected, never assumed. A line with ``barge_in_after_s`` starts the user speaking that
long into the previous reply: the VAD hears it, ingest interrupts, and the agent drops the rest. Any
other line starts ``turn_gap_s`` after the reply has been said (at its own pace, however far ahead its
audio was pushed).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import anyio
import numpy as np

from charstream.stages.agents.asr import TurnRecognizer
from charstream.stages.agents.tts import Speech, synthesize
from charstream.stages.config import AGENT_PACES, IngestConfig
from charstream.stages.ingest.adapters import (
    AgentAudioFrame,
    AgentEvent,
    AgentTurnEnd,
    AgentTurnStart,
    TurnRef,
    UserAudioFrame,
)
from charstream.stages.ingest.resample import resample, to_int16
from charstream.transport.messages import TurnEvent, TurnKind

TICK_S = 0.02
MIC_RATE = 48_000  # the simulated user's microphone, like a WebRTC track
MIC_FRAME = int(MIC_RATE * TICK_S)
SILENCE_LEVEL = 328  # |sample| at or below -40 dBFS counts as silence (ground truth of speech bounds)
VAD_MISSED_AFTER_S = 3.0  # no end of speech this long after the user's line: the VAD missed it


@dataclass
class ScriptLine:
    user: str
    agent: str
    barge_in_after_s: float | None = None  # the user starts this line this far into the previous reply


DEFAULT_SCRIPT = [
    ScriptLine("Hi there! Who am I talking to?",
               "Hello! I'm Ada, a live video character. I can see you're curious about how I work."),
    ScriptLine("How do you make your face move?",
               "A small video model draws each frame from my voice, four frames at a time, as I speak."),
    ScriptLine("Can I interrupt you while you are talking?",
               "Of course. If you start speaking while I talk, I stop and listen to you right away."),
    ScriptLine("That sounds great. Thank you!",
               "You're welcome! It was lovely talking with you. Goodbye for now."),
]


@dataclass
class _Line:
    user: np.ndarray  # int16 at MIC_RATE
    user_voiced: tuple[int, int]  # first and last non-silent sample of ``user``
    agent: Speech  # espeak output at its own rate
    agent_text: str
    barge_in_after_s: float | None


class ScriptedAgent:
    name = "scripted"

    def __init__(self, config: IngestConfig | None = None, session_id: str = "",
                 script: list[ScriptLine] | None = None) -> None:
        self.config = config or IngestConfig()
        if self.config.agent_pace not in AGENT_PACES:
            raise ValueError(f"ingest.agent_pace {self.config.agent_pace!r}: expected one of {', '.join(AGENT_PACES)}")
        if script is None and self.config.script is not None:
            script = [ScriptLine(**line) for line in self.config.script]
        self.script = script or DEFAULT_SCRIPT
        self._lines: list[_Line] = []
        self._user_end: float | None = None  # detection time of the current user line's end (VAD)
        self._ears: TurnRecognizer | None = None
        self._heard: str | None = None  # what the recogniser heard of the current user line
        self._interrupted: set[TurnRef] = set()
        # ground truth for tests and reports: (what, line, wall time), e.g. ("user_speech_end", 0, t)
        # where the user's end is the wall time of the line's last non-silent sample
        self.truth: list[tuple[str, int, float]] = []

    async def start(self) -> None:
        self._lines = await anyio.to_thread.run_sync(self._synthesise)
        if self.config.scripted_recognizer:
            self._ears = await TurnRecognizer.load(self.config.recognizer, MIC_RATE)

    def _synthesise(self) -> list[_Line]:
        voiced_user: dict[str, tuple[np.ndarray, tuple[int, int]]] = {}
        replies: dict[str, Speech] = {}
        lines = []
        for line in self.script:  # a repeated script synthesises each text once
            if line.user not in voiced_user:
                user = synthesize(line.user, self.config.user_voice)
                mic = to_int16(resample(user.samples.astype(np.float32) / 32768.0, user.sample_rate, MIC_RATE))
                voiced = np.flatnonzero(np.abs(mic.astype(np.int32)) > SILENCE_LEVEL)
                voiced_user[line.user] = mic, (int(voiced[0]), int(voiced[-1]))
            if line.agent not in replies:
                replies[line.agent] = synthesize(line.agent, self.config.agent_voice)
            lines.append(_Line(*voiced_user[line.user], replies[line.agent], line.agent, line.barge_in_after_s))
        return lines

    async def hear(self, frame: UserAudioFrame) -> None:
        if self._ears is not None:
            await self._ears.hear(frame.samples)

    async def notify(self, event: TurnEvent) -> None:
        if event.kind == TurnKind.USER_SPEECH_END:
            self._user_end = time.time()
            transcript = await self._ears.speech_ended() if self._ears is not None else None
            if transcript is not None:
                self._heard = " ".join(filter(None, (self._heard, transcript.text)))
        elif event.kind == TurnKind.USER_SPEECH_START:  # a pause inside the line ended no turn
            self._user_end = None
            if self._ears is not None:
                await self._ears.speech_started()

    async def interrupt(self, turn_ref: TurnRef) -> None:
        self._interrupted.add(turn_ref)

    async def close(self) -> None:
        if self._ears is not None:
            await self._ears.close()

    async def events(self) -> AsyncIterator[AgentEvent]:
        """The conversation, one 20 ms tick at a time (see the module docstring)."""
        lines, config = self._lines, self.config
        start = time.time()
        tick = 0
        user_line = -1  # the last line whose user part started
        mic_speech: np.ndarray | None = None  # the user speech being played into the microphone
        said = 0
        user_done_at: float | None = None  # the user's line ended; waiting for the VAD's end of speech
        think_until: float | None = None
        reply_line: int | None = None  # the line whose reply is streaming
        sent = 0
        reply_started = 0.0
        next_user_at = start + config.lead_in_s  # when the next user line may start without barging in
        while True:
            now = time.time()
            nxt = user_line + 1
            idle = mic_speech is None and user_done_at is None and think_until is None
            if idle and nxt < len(lines):
                barge = lines[nxt].barge_in_after_s
                if (reply_line is None and now >= next_user_at) or (
                        reply_line is not None and barge is not None and now - reply_started >= barge):
                    user_line, mic_speech, said, self._user_end, self._heard = nxt, lines[nxt].user, 0, None, None
            # the simulated microphone
            mic = np.zeros(MIC_FRAME, np.int16)
            if mic_speech is not None:
                part = mic_speech[said:said + MIC_FRAME]
                mic[:len(part)] = part
                for what, sample in zip(("user_speech_start", "user_speech_end"), lines[user_line].user_voiced, strict=True):
                    if said <= sample < said + MIC_FRAME:  # stamped like the frame the VAD hears it in
                        self.truth.append((what, user_line, now + (sample - said) / MIC_RATE))
                said += MIC_FRAME
                if said >= len(mic_speech):
                    mic_speech, user_done_at = None, now
            yield UserAudioFrame(mic, MIC_RATE, now)
            # the agent: end of user speech (as the VAD saw it) -> think -> reply
            if user_done_at is not None and self._user_end is not None:
                think_until, user_done_at = self._user_end + config.think_delay_s, None
            elif user_done_at is not None and now - user_done_at > VAD_MISSED_AFTER_S:
                raise RuntimeError(f"scripted agent: no end of speech detected {VAD_MISSED_AFTER_S} s after "
                                   f"line {user_line}'s user speech ended (VAD threshold too high?)")
            if reply_line is not None and reply_line in self._interrupted:
                yield AgentTurnEnd(reply_line, "interrupted")
                reply_line, next_user_at = None, now + config.turn_gap_s
            if think_until is not None and now >= think_until and reply_line is None:
                think_until, reply_line, sent, reply_started = None, user_line, 0, now
                self.truth.append(("agent_turn_start", reply_line, now))
                heard = (self._heard or "") if self._ears is not None else None  # None: nothing listened
                yield AgentTurnStart(reply_line, heard=heard, answer=lines[reply_line].agent_text)
            if reply_line is not None:
                reply = lines[reply_line].agent
                elapsed = int(reply.sample_rate * (now - reply_started))
                # real time: the reply's clock and this tick's 20 ms -- a tick late on a busy machine sends what
                # came due, and the ticks that catch up after it send nothing, so the audio never runs ahead
                until = max(sent, elapsed + int(round(reply.sample_rate * TICK_S)))
                if config.agent_pace == "synthesized":  # all that ingest takes now: max_ahead_s ahead of its clock
                    until = max(until, elapsed + int(reply.sample_rate * config.max_ahead_s))
                if until > sent:
                    yield AgentAudioFrame(reply.samples[sent:until], reply.sample_rate, turn_ref=reply_line)
                sent = until
                if sent >= len(reply.samples):
                    yield AgentTurnEnd(reply_line)
                    # the user waits until the reply has been said, however far ahead its audio was pushed:
                    # only a line with barge_in_after_s talks over the character
                    said_by = reply_started + len(reply.samples) / reply.sample_rate
                    reply_line, next_user_at = None, max(now, said_by) + config.turn_gap_s
            if user_line == len(lines) - 1 and mic_speech is None and user_done_at is None \
                    and think_until is None and reply_line is None:
                return  # the last line is answered (or was interrupted and nothing follows)
            tick += 1
            await anyio.sleep(max(0.0, start + tick * TICK_S - time.time()))
