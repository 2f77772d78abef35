"""Memory of a long-running process: glibc's allocator kept from hoarding what a session frees.

A session's stages allocate torch tensors of 128 KiB to several MB (the decoder's activations,
diffusion's buffers) many times a second, in anyio worker threads that come and go (idle ones are pruned after
10 s). glibc serves each thread from one of up to 8 x cores arenas, and by default raises its mmap
threshold to the largest block freed (up to 32 MiB; the trim threshold to twice that): after the
first big free, those tensors are carved from the arenas' heaps instead of being mapped, and every
arena a worker lands on builds a pool of them that the process keeps. A 30-minute session's RSS
climbed 9.3 MB/min in ~50 MB steps while its live memory stayed flat (docs/PERF.md).

``bound_allocator_pools`` fixes both thresholds at glibc's static default, 128 KiB (fixing them
turns the dynamic raise off): blocks that big are mapped and go back to the OS when freed, and an
arena returns free memory at its top beyond that. Measured on the soak (docs/PERF.md): glibc's
free pool 4-12 MB instead of 130-245 MB, RSS flat; the price is the pages those blocks fault in
(~50,000 a second, ~+20% of the session's CPU on the 2-core VM; fixed at 256 KiB-1 MiB the pools
of the smaller blocks still grew). ``release_free_memory`` (``malloc_trim``) runs every
``memory_trim_s`` for free chunks left in the arenas' middles. Both do nothing without glibc.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import os
import re

_LIBC = ctypes.util.find_library("c")
MALLOC_THRESHOLD_BYTES = 128 << 10
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)
_ENVIRONMENT = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")  # glibc's own; GLIBC_TUNABLES too


def bound_allocator_pools(threshold: int = MALLOC_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap and trim thresholds at ``threshold`` bytes for this process; whether it did
    (False without glibc, or when the environment already sets them: the operator's choice stands)."""
    if any(name in os.environ for name in _ENVIRONMENT) or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        libc = ctypes.CDLL(_LIBC)
        return bool(libc.mallopt(M_MMAP_THRESHOLD, threshold)) and bool(libc.mallopt(M_TRIM_THRESHOLD, threshold))
    except (OSError, AttributeError, TypeError):  # no libc found, or not glibc
        return False


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
