"""Every Triton kernel a serving process compiles, logged: ``kernel_compile`` (kernel's qualified name, ms).

Triton compiles a kernel at its first launch with each new specialisation of its arguments. Mid-session
that stalls the step that launched it: hundreds of ms on the H200 when Triton's on-disk cache is empty
(a machine's first sessions), in every process of the machine at the same frame when they all run the
same script. The line lets a late chunk in a log be matched with the compile that held its stage; a
compile served from the on-disk cache logs too, in a few ms.
"""

from __future__ import annotations

import importlib.util
import threading
import time
from typing import Any

from charstream.logs import get_logger


class _CompileLog:
    """Triton's pre-compile and post-compile hooks (``triton.knobs.runtime``), chained to the ones
    that were set before; a stage thread's compile is timed on that thread."""

    def __init__(self, before: Any, after: Any) -> None:
        self.previous_before, self.previous_after = before, after
        self._started = threading.local()

    def before(self, **kwargs: Any) -> Any:
        # A truthy return tells Triton to skip the compile: only a chained hook may ask that.
        skip = self.previous_before(**kwargs) if self.previous_before is not None else None
        self._started.at = time.perf_counter()
        return skip

    def after(self, **kwargs: Any) -> Any:
        started = self._started.__dict__.pop("at", None)  # this thread's compile, read once
        ms = round((time.perf_counter() - started) * 1e3, 1) if started is not None else None
        get_logger(component="triton").info("kernel_compile", kernel=kwargs["fn"].name, ms=ms)
        return self.previous_after(**kwargs) if self.previous_after is not None else None


def log_kernel_compiles() -> None:
    """Log this process's Triton compiles (once per process, however often this is called); without
    Triton (not on Linux) nothing compiles and nothing is installed."""
    if importlib.util.find_spec("triton") is None:
        return
    from triton import knobs

    runtime = knobs.runtime
    hook = runtime.jit_post_compile_hook
    if not isinstance(getattr(hook, "__self__", None), _CompileLog):
        log = _CompileLog(runtime.jit_cache_hook, hook)
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = log.before, log.after
