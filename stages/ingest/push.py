"""An adapter fed by code: frameworks that own the conversation (Pipecat, LiveKit Agents) push the
agent's turns and speech into it, and learn about barge-in through ``on_interrupt``.

The queue is bounded: ``push`` awaits while ingest is ``capacity`` events behind, so a TTS that runs
faster than real time is slowed to ingest's pace instead of growing memory.

With ``IngestConfig.adapter`` = ``pipecat`` or ``livekit`` the session creates one PushAdapter and
hands it to both sides: its ingest stage reads it, the framework integration pushes into it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import anyio

from charstream.stages.ingest.adapters import (
    AgentAudioFrame,
    AgentEvent,
    AgentTurnStart,
    TurnRef,
    UserAudioFrame,
    UserSpeech,
)
from charstream.transport.messages import TurnEvent, TurnKind


class PushAdapter:
    name = "push"

    def __init__(self, capacity: int = 64) -> None:
        self._send, self._receive = anyio.create_memory_object_stream[AgentEvent](capacity)
        self.on_interrupt: Callable[[TurnRef], Awaitable[None]] | None = None
        self.on_turn_event: Callable[[TurnEvent], Awaitable[None]] | None = None

    async def start(self) -> None:
        pass

    async def push(self, event: AgentEvent) -> None:
        """Hand one event to ingest; awaits while the queue is full."""
        await self._send.send(event)

    async def user_speech(self, kind: TurnKind, at: float, interrupt: bool = False) -> None:
        """The framework's own VAD saw the user start/stop (``at``: onset or back-dated end). A start
        is a barge-in only when the framework says so (``interrupt``): then the queued audio of the
        current turn is dropped before it is handed on."""
        if kind == TurnKind.USER_SPEECH_START and interrupt:
            self.drain()
        await self._send.send(UserSpeech(kind, at, interrupt))

    async def end(self) -> None:
        """No more events: ingest's iteration ends once the queue is drained."""
        await self._send.aclose()

    async def events(self) -> AsyncIterator[AgentEvent]:
        async with self._receive:
            async for event in self._receive:
                yield event

    async def hear(self, frame: UserAudioFrame) -> None:
        pass  # the framework has the user's audio itself

    async def notify(self, event: TurnEvent) -> None:
        if self.on_turn_event is not None:
            await self.on_turn_event(event)

    async def interrupt(self, turn_ref: TurnRef) -> None:
        self.drain()
        if self.on_interrupt is not None:
            await self.on_interrupt(turn_ref)

    def drain(self) -> int:
        """Barge-in: drop the queued audio of the current turn (up to the next turn start); returns
        how many frames were dropped. Turn events and later turns' audio stay queued."""
        dropped, keep, next_turn = 0, [], False
        while True:
            try:
                event = self._receive.receive_nowait()
            except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                break
            next_turn = next_turn or isinstance(event, AgentTurnStart)
            if isinstance(event, AgentAudioFrame) and not next_turn:
                dropped += 1
            else:
                keep.append(event)
        for event in keep:
            self._send.send_nowait(event)
        return dropped

    async def close(self) -> None:
        await self._send.aclose()
        await self._receive.aclose()
