"""Triton compiles are logged (``kernel_compile``), and a session's position resets compile the rotation
kernel once: on CPU, the hooks as Triton calls them; on the GPU (``-m gpu``),
real compiles and a cache stepped through every reset a long session makes."""

from __future__ import annotations

import pytest
import structlog
import torch

triton = pytest.importorskip("triton")

from charstream.logs import configure_logging  # noqa: E402
from charstream.pipeline.runtime.kernel_compiles import log_kernel_compiles  # noqa: E402


class _Fn:  # what Triton passes as ``fn``: a JitFunctionInfo with the kernel's name
    name = "_some_kernel"


@pytest.fixture
def clean_hooks():
    runtime = triton.knobs.runtime
    before = runtime.jit_cache_hook, runtime.jit_post_compile_hook
    runtime.jit_cache_hook = runtime.jit_post_compile_hook = None
    configure_logging()  # before any capture: a first configuration inside one would replace it
    yield runtime
    runtime.jit_cache_hook, runtime.jit_post_compile_hook = before


def test_a_compile_is_logged_once_with_its_time_and_the_hooks_before_still_run(clean_hooks):
    runtime = clean_hooks
    seen = []
    runtime.jit_cache_hook = lambda **kw: seen.append(("before", kw["fn"].name))
    runtime.jit_post_compile_hook = lambda **kw: seen.append(("after", kw["fn"].name))
    log_kernel_compiles()
    log_kernel_compiles()  # installs nothing more: one line per compile below
    kwargs = {"key": "k", "repr": "r", "fn": _Fn(), "compile": {}, "is_manual_warmup": False,
              "already_compiled": False}
    with structlog.testing.capture_logs() as logs:
        skip = runtime.jit_cache_hook(**kwargs)
        runtime.jit_post_compile_hook(**kwargs)
    assert not skip  # a truthy answer would make Triton skip the compile
    [line] = [e for e in logs if e["event"] == "kernel_compile"]
    assert line["kernel"] == "_some_kernel" and line["ms"] >= 0 and line["component"] == "triton", line
    assert seen == [("before", "_some_kernel"), ("after", "_some_kernel")]


def test_a_chained_hook_that_skips_the_compile_is_obeyed(clean_hooks):
    runtime = clean_hooks
    runtime.jit_cache_hook = lambda **kw: True
    log_kernel_compiles()
    assert runtime.jit_cache_hook(key="k", repr="r", fn=_Fn(), compile={}, is_manual_warmup=False,
                                  already_compiled=False) is True


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_real_compile_is_logged_and_a_cached_launch_is_not(clean_hooks):
    import triton.language as tl

    @triton.jit
    def _add_one(x, N: tl.constexpr):  # a new function each run: never in this process's kernel cache
        i = tl.arange(0, N)
        tl.store(x + i, tl.load(x + i) + 1)

    x = torch.zeros(64, device="cuda")
    log_kernel_compiles()
    for launch in range(2):
        with structlog.testing.capture_logs() as logs:
            _add_one[(1,)](x, N=64)
            torch.cuda.synchronize()
        compiled = [e["kernel"] for e in logs if e["event"] == "kernel_compile"]
        assert compiled == ([_add_one.fn.__qualname__] if launch == 0 else [])
    assert (x == 2).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_position_resets_compile_the_rotation_once(clean_hooks):
    """tiny's resets fall on frames 50, 92, 134, ... (ring positions 2 and 8): the frame each skips has
    slot bounds 60/80 at one and 180/200 at the other -- a multiple of 16 and not, which Triton
    specialised on, so the second reset compiled a variant of its own mid-session (a held frame in every
    session of a fresh machine). Every later reset, and a rollback across one, must reuse the first compile."""
    from charstream.kernels.delta_rotate import _delta_rotate_kernel
    from charstream.kernels.fp8 import FP8_DTYPE
    from charstream.kernels.rope import rope_freqs
    from charstream.model.cache import KVCache
    from charstream.model.config import TINY

    _delta_rotate_kernel.device_caches.clear()  # whatever other tests compiled: this test counts its own
    log_kernel_compiles()
    cache = KVCache(TINY, TINY.n_heads, FP8_DTYPE, "cuda", rope_freqs(TINY.head_dim, "cuda"))
    with structlog.testing.capture_logs() as logs:
        cache.reset()  # a session's start: the rotation compiled here, before any frame is due
    assert [e["kernel"] for e in logs if e["event"] == "kernel_compile"] == ["_delta_rotate_kernel"]
    second_reset = TINY.window_frames + 2 * TINY.reset_every
    bounds, deltas, rolled_back = set(), set(), False  # the skipped slots' bounds and the deltas of every rotation
    with structlog.testing.capture_logs() as logs:
        for _ in range(TINY.window_frames + 4 * TINY.reset_every + 1):
            frame, offset = cache.next_frame, cache.offset
            cache.begin_frame()
            if cache.offset != offset:
                first, count = cache._overwritten(frame)
                bounds |= {first, first + count}
                deltas.add(cache.offset - offset)
            cache.end_frame()
            if frame == second_reset and not rolled_back:  # back across it once: a rotation by a negative delta
                cache.rollback(2)
                rolled_back = True
        torch.cuda.synchronize()
    assert any(b % 16 == 0 for b in bounds) and any(b % 16 for b in bounds), bounds
    assert deltas == {TINY.reset_every, -TINY.reset_every} and cache.next_frame > 3 * TINY.reset_every, deltas
    assert not [e for e in logs if e["event"] == "kernel_compile"], "a reset compiled the rotation again"
