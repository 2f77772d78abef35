"""Free memory handed back to the OS in a long-running serving process.

glibc keeps freed memory for reuse: over a 30-minute session the process's RSS climbed 9.3 MB/min
in steps, while with a trim every 10 s it stayed flat (docs/PERF.md). ``malloc_trim(0)`` returns
those free pages; it runs in a worker thread (ctypes releases the GIL), never on the event loop.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util

_LIBC = ctypes.util.find_library("c")


def release_free_memory() -> bool:
    """``malloc_trim(0)``: whether glibc gave pages back (False also without glibc)."""
    try:
        return bool(ctypes.CDLL(_LIBC).malloc_trim(0))
    except (OSError, AttributeError, TypeError):  # no libc found, or not glibc
        return False


async def trim_forever(interval_s: float) -> None:
    """``release_free_memory`` every ``interval_s`` seconds, off the event loop."""
    while True:
        await asyncio.sleep(interval_s)
        await asyncio.to_thread(release_free_memory)
