"""A lab instrument: the libraries' counter memsets of a captured CUDA graph taken off its critical path.

    python scripts/graph_memsets.py [--preset characters-57b --tp 3 --reps 20 --json out.json]

Not in the serving path: the step's graphs are captured as recorded (model/graphs.py). Hoisting measured
no step-level gain (steps 0.05-0.7 ms lower, within the machine's spread: docs/PERF.md), so it stays
here, with its check (a graph of row quantization -> FP8 GEMM pairs: every memset moves, the replay is
unchanged) and the step timed both ways, in turns.

cuBLASLt's FP8 GEMMs and cuDNN's SDPA each issue a 4-byte ``cudaMemsetAsync`` before their kernel
(not documented: by its size a counter in their workspace; ``bench gpu``'s profile attributes every
memset of the step to those two calls), so a stream capture of the step records kernel -> memset ->
library kernel at every such call (720 memset nodes a TP=3 step), and such a boundary idles several
times as long as a kernel -> kernel one (docs/decisions/0009-graph-memsets-off.md). The
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

import argparse
import ctypes
import functools
import json
import statistics
import sys

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
                           "newer); capture without hoisting") from None


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


def _keep_graph_capture(body, stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
    """``body`` warmed up and captured as model/graphs.py does, the graph kept un-instantiated."""
    from charstream.model.graphs import CAPTURE_MODE

    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            body()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph, stream=stream, capture_error_mode=CAPTURE_MODE):
        body()
    return graph


def check() -> dict[str, object]:
    """A graph of kernel -> FP8 GEMM pairs as the step has them (the TP=3 shard's input projection, whose
    cuBLASLt kernel asks a counter memset): each memset moves beside the kernel before it, the GEMM after
    both, and the replay computes what the graph as captured computes."""
    from charstream.kernels.quantize_rows import quantize_rows_triton
    from charstream.model.fp8_linear import quantize_weight

    m, k, n = 757, 7680, 20480
    gen = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    w, w_scale = quantize_weight(torch.randn(n, k, device="cuda", generator=gen) / k**0.5)
    outs = [torch.empty(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(3)]

    def body() -> None:
        h = x
        for out in outs:
            xq, xs = quantize_rows_triton(h)  # our kernel, then the library's memset and GEMM
            out.copy_(torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=w_scale.reshape(1, n), out_dtype=torch.bfloat16,
                                       use_fast_accum=True)[:, :k])
            h = out

    plain = _keep_graph_capture(body, torch.cuda.Stream())
    plain.instantiate()
    plain.replay()
    expected = [o.clone() for o in outs]
    hoisted = _keep_graph_capture(body, torch.cuda.Stream())
    raw = hoisted.raw_cuda_graph()
    memsets = [node for node in _nodes(raw) if _node_type(node) == _MEMSET]
    preceding = {node: _edges(node, "cuGraphNodeGetDependencies") for node in memsets}
    moved = hoist_counter_memsets(hoisted)
    rewired = all(ours not in _edges(node, "cuGraphNodeGetDependencies")
                  and set(_edges(node, "cuGraphNodeGetDependencies")) == set(_edges(ours, "cuGraphNodeGetDependencies"))
                  for node, (ours,) in preceding.items())
    hoisted.instantiate()
    for o in outs:
        o.fill_(float("nan"))
    hoisted.replay()
    torch.cuda.synchronize()
    equal = all(torch.equal(got, want) for got, want in zip(outs, expected, strict=True))
    return {"memsets": len(memsets), "moved": moved, "rewired": rewired, "replay_equal": equal,
            "passed": bool(memsets) and moved == len(memsets) and rewired and equal}


def time_step(preset: str, tp: int, reps: int) -> dict[str, object]:
    """The serving step of one shard (``bench gpu``'s, the full window) re-captured per backend with its
    counter memsets hoisted and as captured: replays timed in turns, and whether the latents are equal."""
    from charstream.model.config import get_preset
    from charstream.model.step import DiffusionStep
    from charstream.pipeline.bench.gpu import _in_turns, build_shard

    cfg = get_preset(preset)
    model, cache = build_shard(cfg, tp)
    cache.begin_frame()
    step = DiffusionStep(model, cache)
    step.set_inputs(torch.randn(cfg.n_audio_tokens, cfg.audio_dim), torch.randn(step.noise.shape), cfg.sink_frames + 7)
    stream, graphs, moved = torch.cuda.Stream(), {}, 0
    with torch.inference_mode():
        for name in ("as_captured", "hoisted"):
            graph = _keep_graph_capture(step._body, stream)
            if name == "hoisted":
                moved = hoist_counter_memsets(graph)
            graph.instantiate()
            graphs[name] = graph
        times = _in_turns({name: graph.replay for name, graph in graphs.items()}, reps)
        latents = {}
        for name, graph in graphs.items():
            graph.replay()
            latents[name] = step.latent.clone()
    return {"backend": step.attention.name, "memsets_moved": moved, "step_ms": times,
            "hoisted_minus_captured_ms": statistics.median(times["hoisted"]) - statistics.median(times["as_captured"]),
            "latents_equal": bool(torch.equal(latents["hoisted"], latents["as_captured"]))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default=None, help="also time this preset's step both ways")
    parser.add_argument("--tp", type=int, default=3)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "check": check()}
    if args.preset:
        result["step"] = time_step(args.preset, args.tp, args.reps)
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if result["check"]["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
