"""glibc's own account of the process's memory (what the soak samples)."""

from __future__ import annotations

import ctypes.util
import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(ctypes.util.find_library("c") is None or sys.platform != "linux",
                                reason="glibc's allocator (Linux) is what is measured")


MAPPED_BLOCK = """
import ctypes, ctypes.util, json
from charstream.stages.shared.memory import allocator_stats
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
before = allocator_stats()
block = libc.malloc(1 << 30)
during = allocator_stats()
libc.free(block)
print(json.dumps([before, during]))
"""


def test_allocator_stats_accounts_for_a_mapped_block():
    # In a fresh interpreter: there a 1 GiB block (never touched: it takes no memory) is always mapped. In
    # the suite's process, a free heap region the earlier tests left can serve even that much.
    out = subprocess.run([sys.executable, "-c", MAPPED_BLOCK], capture_output=True, text=True, timeout=60, check=True)
    before, during = json.loads(out.stdout)
    assert set(before) == {"arenas", "heap_mb", "free_mb", "mapped_mb"} and before["arenas"] >= 1
    assert during["mapped_mb"] - before["mapped_mb"] >= 1024 - 0.01  # each figure is rounded to 0.01 MB
