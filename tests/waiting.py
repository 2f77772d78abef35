"""Polling for a condition in asyncio tests (sessions whose progress is only observable from outside)."""

import asyncio
import time


async def until(condition, timeout: float, poll_s: float = 0.02) -> bool:
    """Await ``condition()`` becoming true; False if ``timeout`` seconds pass first."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(poll_s)
    return True
