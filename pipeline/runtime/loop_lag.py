"""How late an event loop runs: ``LoopLag`` (the capacity bench's workers and the model engine report it)."""

from __future__ import annotations

import asyncio
from collections import deque

import numpy as np

LAG_INTERVAL_S = 0.05  # the lag probe's sleep: its overshoot is how late the loop runs callbacks
MAX_LAG_SAMPLES = 20_000  # ~17 minutes of probes per window


class LoopLag:
    """How late this event loop wakes a sleeper: a probe task sleeps ``LAG_INTERVAL_S`` and records
    the overshoot. A loop busy with Python work (per-frame encode, packets, stages) shows it here."""

    def __init__(self) -> None:
        self.samples: deque[float] = deque(maxlen=MAX_LAG_SAMPLES)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._probe(), name="loop-lag")

    async def _probe(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            asked = loop.time()
            await asyncio.sleep(LAG_INTERVAL_S)
            self.samples.append(max(0.0, loop.time() - asked - LAG_INTERVAL_S))

    def summary(self) -> dict[str, float | int]:
        lag = np.asarray(self.samples, float) * 1e3
        if not len(lag):
            return {"samples": 0}
        return {"samples": len(lag), "p50_ms": round(float(np.percentile(lag, 50)), 2),
                "p99_ms": round(float(np.percentile(lag, 99)), 2), "max_ms": round(float(lag.max()), 2)}

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
