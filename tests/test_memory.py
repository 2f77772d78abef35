"""The serving process's allocator setting: freed big blocks go back to the OS, not into a pool."""

from __future__ import annotations

import ctypes.util
import subprocess
import sys

import pytest
from charstream.stages.memory import allocator_stats

# In a fresh process: one big block freed (glibc's dynamic threshold rises to its size), then 2 MB
# blocks, each followed by a live 256 KiB one (too big for the bins' leftovers, so it lands right
# after), so that freed, the big ones sit in the middle of the heap where only a trim could return
# them. Prints the RSS (MB) that freeing the big ones (48 MB written) gave back.
PROBE = """
import ctypes, ctypes.util, os, sys
from charstream.stages.memory import bound_allocator_pools
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def rss_mb():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
bounded = bound_allocator_pools() if sys.argv[1] == "bounded" else None
libc.free(libc.malloc(8 << 20))
big, small = [], []
for _ in range(24):
    big.append(libc.malloc(2 << 20))
    ctypes.memset(big[-1], 1, 2 << 20)
    small.append(libc.malloc(256 << 10))
before = rss_mb()
for p in big:
    libc.free(p)
print(bounded, round(before - rss_mb(), 1))
"""

pytestmark = pytest.mark.skipif(ctypes.util.find_library("c") is None or sys.platform != "linux",
                                reason="glibc's allocator (Linux) is what is tuned")


def probe(mode: str) -> tuple[str, float]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True,
                         env={"PATH": "/usr/bin:/bin"}).stdout.split()
    return out[0], float(out[1])


def test_freed_big_blocks_are_returned_with_the_pools_bounded():
    _, returned_by_default = probe("default")
    bounded, returned_bounded = probe("bounded")
    assert returned_by_default < 2  # the mechanism: 48 MB of freed tensors stay in the process
    assert bounded == "True" and returned_bounded > 46


def test_an_operators_malloc_environment_is_left_alone():
    out = subprocess.run([sys.executable, "-c", "from charstream.stages.memory import bound_allocator_pools;"
                          "print(bound_allocator_pools())"], capture_output=True, text=True, check=True,
                         env={"PATH": "/usr/bin:/bin", "MALLOC_MMAP_THRESHOLD_": "65536"}).stdout.strip()
    assert out == "False"


def test_allocator_stats_accounts_for_a_mapped_block():
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    before = allocator_stats()
    block = libc.malloc(64 << 20)  # far above any mmap threshold: always mapped
    during = allocator_stats()
    libc.free(block)
    assert set(before) == {"arenas", "heap_mb", "free_mb", "mapped_mb"} and before["arenas"] >= 1
    assert during["mapped_mb"] - before["mapped_mb"] >= 64 - 0.01  # each figure is rounded to 0.01 MB
