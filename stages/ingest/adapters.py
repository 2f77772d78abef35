"""The one interface every voice agent implements, and the registry that picks one by config.

An adapter is a source of events: the agent's turns and speech (at the agent's own rate), and, where
the adapter also owns the user's microphone (the scripted agent plays the simulated user), the user's
audio. The ingest stage (``stages.ingest.stage``) pulls the events, resamples, detects the user's
turns with silero-vad, stamps the trace, and tells the adapter what it detected:

    adapter = create_adapter(config.ingest)
    await adapter.start()
    async for event in adapter.events():      # AgentTurnStart, AgentAudioFrame, AgentTurnEnd, ...
        ...
    await adapter.hear(user_audio_frame)      # the user's microphone, before the VAD sees it
    await adapter.notify(turn_event)          # USER_SPEECH_START / USER_SPEECH_END, as VAD saw them
    await adapter.interrupt(turn_ref)         # barge-in: stop producing this turn's speech
    await adapter.close()

Pulling is the backpressure: an adapter produces its next event only when ingest asks for it.
"""

from __future__ import annotations

import importlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

from charstream.transport.messages import TurnEvent, TurnKind

if TYPE_CHECKING:
    from charstream.stages.config import IngestConfig

TurnRef = str | int | None  # the agent's own name for a turn (echoed back on interrupt)


@dataclass
class AgentTurnStart:
    turn_ref: TurnRef = None
    heard: str | None = None  # what the agent understood the user to say, if it tells (the built-in agent does)
    answer: str | None = None  # the text it is about to speak, if it tells


@dataclass
class AgentAudioFrame:
    """Agent speech at the agent's rate: int16 or float32, interleaved if ``channels`` > 1."""

    samples: np.ndarray
    sample_rate: int
    channels: int = 1
    turn_ref: TurnRef = None


@dataclass
class AgentTurnEnd:
    turn_ref: TurnRef = None
    reason: str = "done"  # done | interrupted


@dataclass
class UserAudioFrame:
    """The user's microphone audio, for turn detection; ``at`` is the wall time of its first sample."""

    samples: np.ndarray
    sample_rate: int
    at: float


@dataclass
class UserSpeech:
    """The user's turn as a framework's own detector saw it (Pipecat's / LiveKit's VAD): handled like
    ingest's VAD events, except that the framework decides barge-in (its interruption setting).
    ``at``: onset, or the back-dated end of speech."""

    kind: TurnKind  # USER_SPEECH_START or USER_SPEECH_END
    at: float
    interrupt: bool = False  # the framework interrupted the agent: barge in (never without it)


@dataclass
class AgentDisconnected:
    """The agent went away (socket silent past its deadline, or said goodbye)."""

    detail: str


@dataclass
class AgentError:
    """The agent sent something unusable (the adapter has already told the agent); ingest logs it
    with the turn id and goes on."""

    problem: str
    turn_ref: TurnRef = None


AgentEvent = (AgentTurnStart | AgentAudioFrame | AgentTurnEnd | UserAudioFrame | UserSpeech | AgentDisconnected
              | AgentError)


@runtime_checkable
class AgentAdapter(Protocol):
    name: str

    async def start(self) -> None:
        """Open sockets, synthesise, connect: whatever must happen before the first event."""

    def events(self) -> AsyncIterator[AgentEvent]:
        """The agent's events, in order; ends when the conversation is over."""

    async def hear(self, frame: UserAudioFrame) -> None:
        """The user's microphone, as ingest receives it and before its VAD decides on it (an agent
        that recognises speech itself listens here; the others ignore it)."""

    async def notify(self, event: TurnEvent) -> None:
        """The user's turn as ingest detected it (USER_SPEECH_START / USER_SPEECH_END)."""

    async def interrupt(self, turn_ref: TurnRef) -> None:
        """Barge-in: the user spoke over turn ``turn_ref``; stop producing its speech."""

    async def close(self) -> None:
        """Release everything; called once, also after an error."""


# IngestConfig.adapter -> "module:Class" of the adapters ingest builds itself; a class takes
# (IngestConfig, session_id). Imported on use: each pulls in its own dependencies (espeak, ZeroMQ).
ADAPTERS: dict[str, str] = {
    "listening": "charstream.stages.agents.listening:ListeningAgent",
    "scripted": "charstream.stages.agents.scripted:ScriptedAgent",
    "zmq": "charstream.stages.ingest.external:ExternalAgent",
}
# pipecat and livekit drive charstream from inside their own pipelines: the integration creates the
# session's ``PushAdapter`` and hands it to the session, which hands it to ingest.
PUSH_ADAPTERS = ("pipecat", "livekit")


def create_adapter(config: IngestConfig, session_id: str = "") -> AgentAdapter:
    """The adapter named by ``config.adapter``, built from the config (for the session)."""
    if config.adapter in PUSH_ADAPTERS:
        raise ValueError(f"ingest adapter {config.adapter!r} is driven from inside the framework: its integration "
                         "hands the session a PushAdapter (charstream.EmbeddedSession); ingest cannot make one")
    target = ADAPTERS.get(config.adapter)
    if target is None:
        raise ValueError(f"unknown ingest adapter {config.adapter!r}; known: {sorted([*ADAPTERS, *PUSH_ADAPTERS])}")
    module, factory = target.split(":")
    return getattr(importlib.import_module(module), factory)(config, session_id)
