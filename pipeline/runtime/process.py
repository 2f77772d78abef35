"""What every process that runs a session's stages does before it serves, and what it keeps doing.

``prepare_process(role, config, stages)`` is called once at each entry point: the serving process
(``session_factory``), a stage process (``pipeline/runtime/hosts.py``'s child entry) and the model
engine (``run_engine``). It configures logging, sets the GIL switch interval (the stages' model
threads share the GIL with the event loop's thread) and imports what the stages run, then freezes the
heap (``pipeline/runtime/heap.py``), all before any channel or heartbeat starts: a long import inside
the event loop would read as a dead peer. The death signal (a child dies with its parent) and the
ignored SIGINT are the supervisor's, given to every child it spawns (``transport/supervisor.py``).

``MemoryTrimmer`` returns glibc's free memory to the OS every ``egress.memory_trim_s``; the process
that owns the serving loop runs it (``charstream serve``, the demo, a fleet node, the benches' servers).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Collection
from typing import Any

from charstream.logs import configure_logging, get_logger
from charstream.pipeline.config import PipelineConfig
from charstream.pipeline.runtime.heap import load_and_freeze
from charstream.stages.shared.memory import trim_forever

ROLES = ("serving", "stage", "engine")
MODEL_STAGES = frozenset({"conditioning", "diffusion", "decode"})


def prepare_process(role: str, config: PipelineConfig, stages: Collection[str],
                    log_level: str | None = None) -> int:
    """Prepare this process to run ``stages`` (the names of the session stages it hosts: ``ingest``
    brings the agent's parts, a model stage the model's). Returns the objects frozen (0 without
    ``config.freeze_heap``). ValueError for a bad ``gil_switch_interval_ms``, before anything changed."""
    if role not in ROLES:
        raise ValueError(f"process role must be one of {', '.join(ROLES)}, got {role!r}")
    configure_logging(log_level)
    config.apply_gil_switch_interval()
    names = set(stages)
    frozen = load_and_freeze(front_end="ingest" in names, model_stages=bool(names & MODEL_STAGES),
                             freeze=config.freeze_heap)
    get_logger(component="process").debug("process_prepared", role=role, pid=os.getpid(), stages=sorted(names),
                                          frozen=frozen)
    return frozen


class MemoryTrimmer:
    """``release_free_memory`` every ``interval_s`` (0: never) from ``start`` to ``stop``, on the
    running asyncio loop; also ``async with``."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self.interval_s > 0 and self._task is None:
            self._task = asyncio.create_task(trim_forever(self.interval_s), name="memory-trim")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def __aenter__(self) -> MemoryTrimmer:
        self.start()
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.stop()
