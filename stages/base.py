"""The one small protocol every stage implements (in the spirit of Pipecat's processors).

A stage receives messages on its input, and emits messages through its context; emitting awaits
credit from the downstream edge, so a slow consumer slows its producer instead of growing a queue.
Control messages (interrupt, rollback, shutdown) arrive through ``control`` and overtake data.
Sources and clock-driven stages (agent adapters, playout) put their loop in ``run``.

The runner (``pipeline.runner``) calls, per stage: ``setup`` once, then ``run`` as a task beside
the loop that feeds ``process`` and ``control``, then ``teardown`` once, also after an error.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import structlog

from charstream.transport.messages import Control, Message

Emit = Callable[[Message], Awaitable[None]]


@dataclass
class StageContext:
    """What the runner hands a stage: its identity, outputs and logger. A stage's configuration
    and the live objects it works with are constructor arguments, never found through the context."""

    stage: str
    session_id: str
    emit: Emit  # data to the stage's downstream edge (awaits credit)
    send_control: Callable[[Control], Awaitable[None]]  # to the control channel (all stages see it)
    log: structlog.typing.FilteringBoundLogger


class Stage:
    """Base class with no-op hooks; subclasses override what they need."""

    name: str = "stage"
    # True: the runner delivers control messages while ``process`` is still awaiting (the stage must
    # then re-check its state after each await in ``process``, e.g. the rollback epoch).
    control_during_process: bool = False

    async def setup(self, ctx: StageContext) -> None:
        """Allocate resources (models, sockets). Called once before anything else."""

    async def run(self, ctx: StageContext) -> None:
        """Long-running loop for sources and clock-driven stages. Returning ends nothing else."""

    async def process(self, msg: Message, ctx: StageContext) -> None:
        """Handle one data message from upstream; emit results with ``await ctx.emit(...)``."""

    async def control(self, msg: Control, ctx: StageContext) -> None:
        """Handle a control message (it overtakes data)."""

    async def teardown(self) -> None:
        """Release resources. Called once, also after an error."""
