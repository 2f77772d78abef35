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
