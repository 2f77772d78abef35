"""How late an event loop runs: ``LoopLag`` (the capacity bench's workers, the model engine and the
HTTP fuzz report it)."""

from __future__ import annotations

import asyncio
from collections import deque

import numpy as np

LAG_INTERVAL_S = 0.05  # the lag probe's sleep: its overshoot is how late the loop runs callbacks
MAX_LAG_SAMPLES = 20_000  # ~17 minutes of probes per window
RECENT_S = 120.0  # how far back ``worst_between`` can look


class LoopLag:
    """How late this event loop wakes a sleeper: a probe task sleeps ``LAG_INTERVAL_S`` and records
    the overshoot. A loop busy with Python work (per-frame encode, packets, stages) shows it here."""

    def __init__(self) -> None:
        self.samples: deque[float] = deque(maxlen=MAX_LAG_SAMPLES)
        # (woke at, lag) on the monotonic clock, for asking how late the loop ran around a given moment
        self.recent: deque[tuple[float, float]] = deque(maxlen=int(RECENT_S / LAG_INTERVAL_S))
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._probe(), name="loop-lag")

    async def _probe(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            asked = loop.time()
            await asyncio.sleep(LAG_INTERVAL_S)
            woke = loop.time()  # time.monotonic(): asyncio's clock
            lag = max(0.0, woke - asked - LAG_INTERVAL_S)
            self.samples.append(lag)
            self.recent.append((woke, lag))

    def late_between(self, start: float, end: float) -> tuple[float, float]:
        """(longest, total) seconds the loop ran late in ``[start, end]`` (``time.monotonic()``); a stall
        still going on at ``end`` counts up to ``end``. Safe to call from another thread."""
        return late_between(list(self.recent), start, end)

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


def late_between(recent: list[tuple[float, float]], start: float, end: float) -> tuple[float, float]:
    """(longest, total) lag of ``(woke at, lag)`` samples of a ``LAG_INTERVAL_S`` probe overlapping
    ``[start, end]``, with the wait since the last sample if it overshoots by ``end``."""
    lags = [lag for woke, lag in recent if woke >= start and woke - lag - LAG_INTERVAL_S <= end]
    last = recent[-1][0] if recent else start
    ongoing = max(0.0, end - max(last, start) - LAG_INTERVAL_S)
    return max([*lags, ongoing]), sum(lags) + ongoing
