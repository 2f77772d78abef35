"""Full-window attention over FP8 codes through cuDNN's FP8 SDPA (Hopper and newer).

Contract: ``q8`` (T, n_heads, head_dim) e4m3 codes with the strides the plan was built for, ``k8`` and
``v8`` one layer's window (n_heads, S, head_dim) of e4m3 codes, contiguous; the real values are the
codes times the 1-element float32 descales ``descale_q``, ``descale_k``, ``descale_v`` (device
tensors, read when the call runs: a session's scales change without a rebuild). Softmax scale
``softmax_scale`` (fixed when built). The output is written into ``out8`` (T, n_heads, head_dim)
e4m3, contiguous, as the real output times ``scale_o`` (1 element): on Hopper cuDNN's FP8 SDPA gives
FP8 output only (bf16 output from FP8 inputs is Blackwell's). Inside, cuDNN stores the softmax
probabilities in e4m3 too (scaled by 448, their largest code), which is where most of its error
against fp32 math over the same codes comes from.

cuDNN is reached through NVIDIA's Python frontend (``nvidia-cudnn-frontend``, a device-only
dependency: bundled for a GPU host by ``scripts/gpu_run.sh``); the frontend loads the cuDNN library
that torch loaded. One object per shape: building its plan takes ~1 s.

Split window (``splits`` = K > 1): the window's keys in K equal partitions, each attended by every query
as one batch entry of one call (q read K times through a batch stride of 0, partition j's keys a
strided view of the same window), so cuDNN runs K x heads x query tiles, each over 1/K of the keys.
Its 128-query tiles (heads x 6 at 757 queries) fill 90 of an H200's 132 SMs at 15 heads (the TP=4
shard); split 4 ways they are ~2.7 waves of a quarter of the work (docs/decisions/0003-split-fp8-window.md).
The call then writes each partition's output (K, T, n_heads, head_dim) and its softmax statistics
``lse`` (K, n_heads, T) (natural-log log-sum-exp of the scaled scores), which
``kernels/attention_merge.py`` merges. ``choose_window_splits`` picks K from that wave count.
"""

from __future__ import annotations

import math

import torch

from charstream.kernels.fp8 import FP8_DTYPE, FP8_MAX

# cuDNN's amax results written out: none is read (the scales are fixed per session), and each one
# written costs a memset node per call in the step's graph
AMAX_OUTPUTS: tuple[str, ...] = ()
# cuDNN's FP8 SDPA query tile on Hopper (rows of queries per CTA, one CTA an SM): what choose_window_splits counts
QUERY_TILE = 128
# each partition beyond the first costs ~3% of the unsplit time in tile starts and ends (the H200 at 20 heads,
# where the waves do not change: 2, 4, 8 ways +2.7%, +8.7%, +23%)
SPLIT_OVERHEAD = 0.03
# and a split must save this much more, for its merge (a launch over the partitions' outputs)
MIN_SPLIT_SAVING = 0.05


def choose_window_splits(n_heads: int, n_queries: int, n_keys: int, n_sms: int,
                         candidates: tuple[int, ...] = (2, 4, 8)) -> int:
    """How many key partitions the window's attention runs in: the candidate (dividing ``n_keys``) whose
    waves of query tiles, each over 1/K of the keys, take the least time with ``SPLIT_OVERHEAD``, if
    that is ``MIN_SPLIT_SAVING`` under one partition's; else 1. At 757 queries on 132 SMs: 15 heads
    4 ways (3 waves of a quarter for 1 of the whole), 20 heads 1, 30 heads 2."""
    tiles = n_heads * math.ceil(n_queries / QUERY_TILE)

    def cost(k: int) -> float:
        return math.ceil(tiles * k / n_sms) / k * (1 + SPLIT_OVERHEAD * (k - 1))

    best = min((k for k in candidates if n_keys % k == 0), key=cost, default=1)
    return best if cost(best) <= (1 - MIN_SPLIT_SAVING) * cost(1) else 1


def fp8_window_attention_reference(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, descale_q: torch.Tensor,
                                   descale_k: torch.Tensor, descale_v: torch.Tensor,
                                   softmax_scale: float) -> torch.Tensor:
    """The real output (T, n_heads, head_dim) float32: fp32 math over the codes' real values, the
    probabilities unquantized."""
    q = q8.float() * descale_q.float()
    k = k8.float() * descale_k.float()
    v = v8.float() * descale_v.float()
    p = (torch.einsum("thd,hsd->hts", q, k) * softmax_scale).softmax(-1)
    return torch.einsum("hts,hsd->thd", p, v)


def fp8_window_partials_reference(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, descale_q: torch.Tensor,
                                  descale_k: torch.Tensor, descale_v: torch.Tensor, softmax_scale: float,
                                  splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A split window's results in fp32: each partition's real output (K, T, n_heads, head_dim), as
    ``fp8_window_attention_reference`` over its keys, and its statistics (K, n_heads, T), the natural-log
    log-sum-exp of its scaled scores."""
    k_parts, v_parts = k8.chunk(splits, dim=1), v8.chunk(splits, dim=1)
    q = q8.float() * descale_q.float()
    outs, lses = [], []
    for kp, vp in zip(k_parts, v_parts, strict=True):
        outs.append(fp8_window_attention_reference(q8, kp, vp, descale_q, descale_k, descale_v, softmax_scale))
        scores = torch.einsum("thd,hsd->hts", q, kp.float() * descale_k.float()) * softmax_scale
        lses.append(scores.logsumexp(-1))
    return torch.stack(outs), torch.stack(lses)


class Fp8WindowAttention:
    """cuDNN's FP8 SDPA built once for one shape and q layout; ``__call__`` runs it on the current
    stream (capturable in a CUDA graph: the handle follows the stream at every call)."""

    def __init__(self, n_heads: int, n_queries: int, n_keys: int, head_dim: int, q_strides: tuple[int, int, int],
                 softmax_scale: float, device: torch.device | str = "cuda",
                 amax_outputs: tuple[str, ...] = AMAX_OUTPUTS, splits: int = 1, plan: int | None = None) -> None:
        """``amax_outputs``: which of cuDNN's amax results (``"s"``: the scores', ``"o"``: the output's)
        are written out; the others stay virtual (each written one is a memset and an atomic per call).
        ``splits``: the window's key partitions (module docstring). ``plan``: the index of cuDNN's
        execution plan to build and run (``plan_count`` of them; None: the heuristics' first)."""
        if not set(amax_outputs) <= {"s", "o"}:
            raise ValueError(f"amax_outputs names 's' and 'o' only, got {amax_outputs}")
        if splits < 1 or n_keys % splits:
            raise ValueError(f"splits must be >= 1 and divide the window's {n_keys} keys, got {splits}")
        try:
            import cudnn
        except ImportError as exc:
            raise RuntimeError("Fp8WindowAttention needs NVIDIA's cuDNN frontend (pip install "
                               "'charstream[fp8-attention]'; scripts/gpu_run.sh carries it to the device)") from exc
        torch.backends.cudnn.version()  # torch's cuDNN loaded first, so the frontend binds to that one
        self._cudnn = cudnn
        self.shape, self.q_strides, self.splits = (n_heads, n_queries, n_keys, head_dim), tuple(q_strides), splits
        fp8, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
        self.handle = cudnn.create_handle()
        graph = cudnn.pygraph(io_data_type=fp8, intermediate_data_type=f32, compute_data_type=f32,
                              handle=self.handle)
        st, sh, sd = q_strides
        part = n_keys // splits  # a batch entry: every query (batch stride 0) over one partition's keys
        q = graph.tensor(name="q", dim=[splits, n_heads, n_queries, head_dim],
                         stride=[0 if splits > 1 else n_queries * st, sh, st, sd], data_type=fp8)
        kv_stride = [part * head_dim if splits > 1 else n_heads * n_keys * head_dim, n_keys * head_dim, head_dim, 1]
        k = graph.tensor(name="k", dim=[splits, n_heads, part, head_dim], stride=kv_stride, data_type=fp8)
        v = graph.tensor(name="v", dim=[splits, n_heads, part, head_dim], stride=kv_stride, data_type=fp8)
        scalars = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
        self._scalars = {name: graph.tensor(name=name, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=f32)
                         for name in scalars}
        o, stats, amax_s, amax_o = graph.sdpa_fp8(q=q, k=k, v=v, **self._scalars, attn_scale=softmax_scale,
                                                  generate_stats=splits > 1, use_causal_mask=False, name="window")
        o.set_output(True).set_dim([splits, n_heads, n_queries, head_dim]).set_data_type(fp8).set_stride(
            [n_queries * n_heads * head_dim, head_dim, n_heads * head_dim, 1])
        self._stats = None
        if splits > 1:
            stats.set_output(True).set_dim([splits, n_heads, n_queries, 1]).set_stride(
                [n_heads * n_queries, n_queries, 1, 1]).set_data_type(f32)
            self._stats = stats
        self._amax = {name: amax for name, amax in (("s", amax_s), ("o", amax_o)) if name in amax_outputs}
        for amax in (amax_s, amax_o):  # a virtual one needs its dims too (the frontend refuses it otherwise)
            amax.set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(f32)
        for amax in self._amax.values():
            amax.set_output(True)
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        self.plan_count = graph.get_execution_plan_count()
        if plan is None:
            graph.build_plans()
            workspace = graph.get_workspace_size()
        else:
            if not 0 <= plan < self.plan_count:
                raise ValueError(f"plan {plan} is not one of cuDNN's {self.plan_count} plans for this shape")
            graph.build_plan_at_index(plan)
            workspace = graph.get_workspace_size_plan_at_index(plan)
        self.plan = plan
        self.graph, self._q, self._k, self._v, self._o = graph, q, k, v, o
        dev = torch.device(device)
        self.workspace = torch.empty(max(workspace, 1), dtype=torch.uint8, device=dev)
        # the probabilities' scale: p in [0, 1] stored as p x 448 (e4m3's largest code)
        self.scale_s = torch.full((1,), FP8_MAX, dtype=torch.float32, device=dev)
        self.descale_s = torch.full((1,), 1.0 / FP8_MAX, dtype=torch.float32, device=dev)
        self.amax_out = torch.empty(2, dtype=torch.float32, device=dev)

    def __call__(self, q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, descale_q: torch.Tensor,
                 descale_k: torch.Tensor, descale_v: torch.Tensor, scale_o: torch.Tensor,
                 out8: torch.Tensor, lse: torch.Tensor | None = None) -> torch.Tensor:
        """``out8``: (T, n_heads, head_dim), or with splits (K, T, n_heads, head_dim) -- one output per
        partition -- and then ``lse`` (K, n_heads, T) float32, contiguous, for their statistics."""
        h, n_q, n_k, d = self.shape
        out_shape = (n_q, h, d) if self.splits == 1 else (self.splits, n_q, h, d)
        if q8.shape != (n_q, h, d) or k8.shape != (h, n_k, d) or v8.shape != (h, n_k, d) or out8.shape != out_shape:
            raise ValueError(f"shapes q {tuple(q8.shape)} k {tuple(k8.shape)} v {tuple(v8.shape)} out "
                             f"{tuple(out8.shape)} do not match the plan's (heads, queries, keys, dim) {self.shape} "
                             f"in {self.splits} partition(s)")
        if q8.stride() != self.q_strides or not (k8.is_contiguous() and v8.is_contiguous() and out8.is_contiguous()):
            raise ValueError(f"q strides {q8.stride()} (the plan's {self.q_strides}) or a non-contiguous k, v or out")
        if any(t.dtype != FP8_DTYPE for t in (q8, k8, v8, out8)):
            raise ValueError("q, k, v and out must be float8_e4m3fn codes")
        if (lse is None) != (self.splits == 1) or (lse is not None and (
                lse.shape != (self.splits, h, n_q) or lse.dtype != torch.float32 or not lse.is_contiguous())):
            raise ValueError(f"a split window needs lse ({self.splits}, {h}, {n_q}) float32, contiguous; one "
                             f"partition none, got {None if lse is None else (tuple(lse.shape), lse.dtype)}")
        self._cudnn.set_stream(handle=self.handle, stream=torch.cuda.current_stream().cuda_stream)
        s = self._scalars
        pack = {self._q: q8, self._k: k8, self._v: v8, self._o: out8,
                s["descale_q"]: descale_q, s["descale_k"]: descale_k, s["descale_v"]: descale_v,
                s["descale_s"]: self.descale_s, s["scale_s"]: self.scale_s, s["scale_o"]: scale_o,
                **{amax: self.amax_out[i : i + 1] for i, amax in enumerate(self._amax.values())}}
        if self._stats is not None:
            pack[self._stats] = lse
        if self.plan is None:
            self.graph.execute(pack, self.workspace, handle=self.handle)
        else:
            self.graph.execute_plan_at_index(pack, self.workspace, self.plan, handle=self.handle)
        return out8
