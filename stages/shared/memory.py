"""Memory of a long-running process: glibc's account of what it keeps, and returning its free memory.

A session's stages allocate torch tensors of 128 KiB to several MB (the decoder's activations,
diffusion's buffers) many times a second. glibc raises its mmap threshold to the largest block freed
(up to 32 MiB; the trim threshold to twice that), so those tensors are carved from the heap of the
allocating thread's arena, and freed go to that arena's free pool for the next ones. The pool stays
bounded because each model stage does its torch work on one long-lived thread of its own
(stages/shared/worker.py): a few arenas hold the big blocks. While the stages ran on anyio's pooled workers,
which come and go, every one of up to 8 x cores arenas a worker landed on built a pool of its own,
and a 30-minute session's RSS climbed 9.3 MB/min in ~50 MB steps (docs/PERF.md). Fixing both
thresholds at 128 KiB bounded that too, but then every freed block went back to the OS and its pages
faulted in fresh when the next was allocated: ~42,000 faults a second and ~25% more of the session's
CPU than glibc's default with per-stage threads, measured side by side (docs/PERF.md), so the default
stays. An operator can still fix them with glibc's own environment (``MALLOC_MMAP_THRESHOLD_``,
``MALLOC_TRIM_THRESHOLD_``, ``GLIBC_TUNABLES``).

``release_free_memory`` (``malloc_trim``) runs every ``memory_trim_s`` for free memory glibc would
keep; ``allocator_stats`` is glibc's own account (the soak samples it). Both do nothing without glibc.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import re

_LIBC = ctypes.util.find_library("c")


def allocator_stats() -> dict[str, float]:
    """glibc's own account (``malloc_info``): arenas, MB it holds from the OS in its heaps, of that
    MB free (its pool), and MB in mapped blocks; empty without glibc."""
    try:
        libc = ctypes.CDLL(_LIBC)
        libc.open_memstream.restype = ctypes.c_void_p
        libc.open_memstream.argtypes = [ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_size_t)]
        libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
        libc.fclose.argtypes = libc.free.argtypes = [ctypes.c_void_p]
        buffer, size = ctypes.c_char_p(), ctypes.c_size_t()
        stream = libc.open_memstream(ctypes.byref(buffer), ctypes.byref(size))
        libc.malloc_info(0, stream)
        libc.fclose(stream)
        text = buffer.value.decode()
        libc.free(buffer)
    except (OSError, AttributeError, TypeError):
        return {}
    totals = text.rsplit("</heap>", 1)[-1]  # after the per-arena sections: the process's totals

    def total(pattern: str) -> float:
        match = re.search(pattern, totals)
        return round(int(match[1]) / 2**20, 2) if match else 0.0

    free = total(r'<total type="fast" count="\d+" size="(\d+)"/>') + total(r'<total type="rest" count="\d+" size="(\d+)"/>')
    return {"arenas": text.count("<heap nr="), "heap_mb": total(r'<system type="current" size="(\d+)"/>'),
            "free_mb": round(free, 2), "mapped_mb": total(r'<total type="mmap" count="\d+" size="(\d+)"/>')}


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
