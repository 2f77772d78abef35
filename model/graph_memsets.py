"""The libraries' counter memsets of a captured CUDA graph taken off its critical path.

cuBLASLt's FP8 GEMMs and cuDNN's SDPA each issue a 4-byte ``cudaMemsetAsync`` before their kernel
(not documented: by its size a counter in their workspace; ``bench gpu``'s profile attributes every
memset of the step to those two calls), so a stream capture of the step records kernel -> memset ->
library kernel at every such call (720 memset nodes a TP=3 step), and such a boundary idles several
times as long as a kernel -> kernel one. Off in the serving step: no step-level gain measured
(docs/decisions/0009-graph-memsets-off.md). The
memset does not depend on the kernel before it -- that kernel is ours and never touches a library's
workspace -- only on the library call before it, which used the same counter. So each such memset is
made to depend on its predecessor's predecessors instead, and its successor on both: the memset runs
beside our kernel, and the library kernel waits for our kernel alone. It still follows every node the
predecessor follows (a node's ancestors are its predecessors' and theirs), so it waits for the previous
library call as before; only a predecessor that is itself a library kernel after a memset -- a user of
such a counter -- keeps its memset after it.

``hoist_counter_memsets(graph)`` rewrites a ``torch.cuda.CUDAGraph(keep_graph=True)`` after its
capture, before ``instantiate()``, through the CUDA driver's graph API (ctypes over libcuda: the driver
is there wherever a graph is). Only memsets of at most ``MAX_COUNTER_BYTES`` whose one predecessor is a
kernel node that no such memset precedes move; anything else stays as captured.
"""

from __future__ import annotations

import ctypes
import functools

import torch

MAX_COUNTER_BYTES = 16  # the libraries' counters are 4 bytes; a larger memset stays in order
_KERNEL, _MEMSET = 0, 2  # CUgraphNodeType


class _MemsetParams(ctypes.Structure):  # CUDA_MEMSET_NODE_PARAMS
    _fields_ = [("dst", ctypes.c_uint64), ("pitch", ctypes.c_size_t), ("value", ctypes.c_uint),
                ("element_size", ctypes.c_uint), ("width", ctypes.c_size_t), ("height", ctypes.c_size_t)]


@functools.cache
def _driver() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def _entry(name: str):
    try:
        return getattr(_driver(), name)
    except AttributeError:
        raise RuntimeError(f"the CUDA driver has no {name} (graph edges with edge data: drivers for CUDA 12.3 and "
                           "newer); capture with hoist_memsets=False") from None


def _check(result: int, what: str) -> None:
    if result != 0:
        raise RuntimeError(f"CUDA driver {what} failed: CUresult {result}")


def _nodes(graph: int) -> list[int]:
    count = ctypes.c_size_t(0)
    _check(_driver().cuGraphGetNodes(ctypes.c_void_p(graph), None, ctypes.byref(count)), "cuGraphGetNodes")
    nodes = (ctypes.c_void_p * count.value)()
    _check(_driver().cuGraphGetNodes(ctypes.c_void_p(graph), nodes, ctypes.byref(count)), "cuGraphGetNodes")
    return [n for n in nodes[: count.value]]


def _node_type(node: int) -> int:
    kind = ctypes.c_int(-1)
    _check(_driver().cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind)), "cuGraphNodeGetType")
    return kind.value


def _edges(node: int, name: str) -> list[int]:
    # the edge-data (_v2) forms, with no edge data: a captured graph's edges are all default ones
    fn = _entry(f"{name}_v2")
    count = ctypes.c_size_t(0)
    _check(fn(ctypes.c_void_p(node), None, None, ctypes.byref(count)), name)
    if count.value == 0:  # a root (or a leaf): the driver refuses an array for no edges
        return []
    found = (ctypes.c_void_p * count.value)()
    _check(fn(ctypes.c_void_p(node), found, None, ctypes.byref(count)), name)
    return [n for n in found[: count.value]]


def _memset_bytes(node: int) -> int:
    params = _MemsetParams()
    _check(_driver().cuGraphMemsetNodeGetParams(ctypes.c_void_p(node), ctypes.byref(params)),
           "cuGraphMemsetNodeGetParams")
    return params.element_size * params.width * params.height


def _set_edges(graph: int, name: str, pairs: list[tuple[int, int]]) -> None:
    if not pairs:
        return
    sources = (ctypes.c_void_p * len(pairs))(*(a for a, _ in pairs))
    targets = (ctypes.c_void_p * len(pairs))(*(b for _, b in pairs))
    _check(_entry(f"{name}_v2")(ctypes.c_void_p(graph), sources, targets, None, ctypes.c_size_t(len(pairs))), name)


def hoist_counter_memsets(graph: torch.cuda.CUDAGraph) -> int:
    """Move each small memset that follows one of our kernels to run beside it (see the module's
    docstring); returns how many moved. ``graph``: captured with ``keep_graph=True``, not yet
    instantiated (or instantiated again after this)."""
    raw = graph.raw_cuda_graph()
    counters = [n for n in _nodes(raw) if _node_type(n) == _MEMSET and _memset_bytes(n) <= MAX_COUNTER_BYTES]
    counter_users = {user for n in counters for user in _edges(n, "cuGraphNodeGetDependentNodes")}
    moved = 0
    for node in counters:
        before = _edges(node, "cuGraphNodeGetDependencies")
        if len(before) != 1 or _node_type(before[0]) != _KERNEL or before[0] in counter_users:
            continue
        ours = before[0]
        after = _edges(node, "cuGraphNodeGetDependentNodes")
        earlier = _edges(ours, "cuGraphNodeGetDependencies")
        _set_edges(raw, "cuGraphRemoveDependencies", [(ours, node)])
        _set_edges(raw, "cuGraphAddDependencies", [(e, node) for e in earlier] + [(ours, a) for a in after])
        moved += 1
    return moved
