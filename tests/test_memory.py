"""glibc's own account of the process's memory (what the soak samples)."""

from __future__ import annotations

import ctypes.util
import sys

import pytest

from charstream.stages.shared.memory import allocator_stats

pytestmark = pytest.mark.skipif(ctypes.util.find_library("c") is None or sys.platform != "linux",
                                reason="glibc's allocator (Linux) is what is measured")


def test_allocator_stats_accounts_for_a_mapped_block():
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    before = allocator_stats()
    # Above glibc's largest mmap threshold (32 MiB) and larger than any free heap region the earlier tests
    # can leave (a 64 MiB block was once served from one: with the dynamic thresholds a freed top stays
    # up to 64 MiB), so it is mapped; never touched, it takes no memory.
    block = libc.malloc(1 << 30)
    during = allocator_stats()
    libc.free(block)
    assert set(before) == {"arenas", "heap_mb", "free_mb", "mapped_mb"} and before["arenas"] >= 1
    assert during["mapped_mb"] - before["mapped_mb"] >= 1024 - 0.01  # each figure is rounded to 0.01 MB
