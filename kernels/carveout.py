"""The shared-memory carveout of the memory-bound Triton kernels that run between the step's GEMMs.

A kernel that uses little shared memory runs, by the driver's default, with a small carveout (the
rest of the SM's 256 KB as L1). When the next kernel -- a cuBLAS FP8 GEMM, cuDNN's attention --
needs most of the SM's shared memory, every SM must first drain and change its split. One replay of
the step's graph profiled on the H200 (docs/PERF.md, issue 14, run 5) shows 4.4-6.2 us between a
small Triton kernel and the GEMM or attention after it, against ~0.6 us at every other boundary:
3.6 of the step's 4.6 ms of launch gaps. Asking the largest carveout for those Triton kernels too
keeps one split for the whole step (they stream their bytes; L1 does little for them).
"""

from __future__ import annotations

import ctypes
import functools

PREFERRED_SHARED_MEMORY_CARVEOUT = 9  # CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT (cuda.h)
CARVEOUT_DEFAULT, CARVEOUT_MAX_SHARED = -1, 100  # CU_SHAREDMEM_CARVEOUT_DEFAULT / _MAX_SHARED (percent)

_maxed: set[int] = set()


@functools.cache
def _cu_func_set_attribute():
    return ctypes.CDLL("libcuda.so.1").cuFuncSetAttribute


def set_carveout(kernel, percent: int) -> None:
    """Set the preferred shared-memory carveout (percent, or -1 for the driver's choice) of a launched
    Triton kernel (the ``CompiledKernel`` a launch returns) for all its later launches."""
    rc = _cu_func_set_attribute()(ctypes.c_void_p(kernel.function), ctypes.c_int(PREFERRED_SHARED_MEMORY_CARVEOUT),
                                  ctypes.c_int(percent))
    if rc != 0:
        raise RuntimeError(f"cuFuncSetAttribute(preferred shared memory carveout, {percent}) failed: CUresult {rc}")
    if percent == CARVEOUT_MAX_SHARED:
        _maxed.add(kernel.function)
    else:
        _maxed.discard(kernel.function)


def prefer_max_shared_memory(kernel) -> None:
    """``set_carveout(kernel, 100)`` once per compiled kernel (later calls cost a set lookup)."""
    if kernel.function not in _maxed:
        set_carveout(kernel, CARVEOUT_MAX_SHARED)
