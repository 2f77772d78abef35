"""The serving process's long-lived heap, frozen out of Python's full garbage collections.

A full (generation 2) collection walks every tracked object while holding the GIL. A serving process
holds ~285,000 of them once a session has loaded -- modules, mostly torch's lazily imported sympy --
and each full collection held the GIL 110-156 ms on a 2-core VM, every few minutes: a speaking chunk
late by that much is a held frame (docs/PERF.md, "Hours of use"). So the process imports what its
sessions will run before it serves, then ``gc.freeze()``: what is alive then lives as long as the
process, and later full collections walk only what sessions create. What they still cost is logged:
every collection of at least ``LONG_COLLECTION_S`` is a ``gc_pause`` line (generation, ms, objects
collected), so a late chunk in a log can be matched with the pause that held its process; where model
stages run, so is every Triton compile (``kernel_compile``, ``pipeline/runtime/kernel_compiles.py``).
"""

from __future__ import annotations

import atexit
import gc
import importlib
import importlib.util
import time
from typing import Any

from charstream.logs import get_logger
from charstream.pipeline.runtime.kernel_compiles import log_kernel_compiles

LONG_COLLECTION_S = 0.01  # a quarter of a frame: a pass this long can hold a frame's release

# What a session's stages import lazily, at their load (off the event loop): the agent's VAD, recogniser
# and TTS in the front-end; the model, its weights and torch's symbolic shapes where model stages run.
FRONT_END_MODULES = ("silero_vad", "pocketsphinx", "espeakng_loader", "anyio.to_thread")
MODEL_MODULES = tuple(f"charstream.model.{m}" for m in (
    "audio_encoder", "batched_decoder", "character", "generator", "graphed_audio_encoder", "graphed_decoder", "graphs", "step.batched",
    "threads", "vae", "weights"))


def load_and_freeze(front_end: bool, model_stages: bool, freeze: bool = True) -> int:
    """Import the modules a session runs in this process (``front_end``: ingest's agent parts;
    ``model_stages``: the model's), then, with ``freeze``, collect and freeze every object alive.
    Returns the objects frozen (0 without ``freeze``)."""
    # A front-end module the environment lacks is a part its sessions cannot run (the recogniser is
    # needed by the built-in agent only): its stage raises then, as it does without this import.
    front = [name for name in FRONT_END_MODULES if importlib.util.find_spec(name) is not None] if front_end else []
    for name in front + list(MODEL_MODULES if model_stages else ()):
        importlib.import_module(name)
    if model_stages:
        import torch

        # torch imports sympy (~13,000 functions) at a module's first to_empty, which loading a model does
        torch.nn.Linear(1, 1, device="meta").to_empty(device="cpu")
        log_kernel_compiles()
    log_long_collections()
    if not freeze:
        return 0
    gc.collect()
    gc.freeze()
    # Unfrozen at exit, so the interpreter's shutdown collects them (triton's bindings report leaks otherwise).
    atexit.unregister(gc.unfreeze)  # once, however many servers this process builds
    atexit.register(gc.unfreeze)
    return gc.get_freeze_count()


class _CollectionTimer:
    """A ``gc.callbacks`` entry: times each collection, logs those of at least ``min_s``."""

    def __init__(self, min_s: float) -> None:
        self.min_s = min_s
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        took = time.perf_counter() - self._started
        if took >= self.min_s:
            get_logger(component="gc").info("gc_pause", generation=info["generation"], ms=round(took * 1e3, 1),
                                             collected=info["collected"], uncollectable=info["uncollectable"])


def _stop_timing(timer: _CollectionTimer) -> None:
    if timer in gc.callbacks:
        gc.callbacks.remove(timer)


def log_long_collections(min_s: float = LONG_COLLECTION_S) -> None:
    """Log this process's garbage collections of at least ``min_s`` (one timer per process, however
    often this is called; a later call sets its threshold)."""
    timer = next((cb for cb in gc.callbacks if isinstance(cb, _CollectionTimer)), None)
    if timer is None:
        timer = _CollectionTimer(min_s)
        gc.callbacks.append(timer)
        atexit.register(_stop_timing, timer)  # the interpreter's shutdown collections are no serving pause
    else:
        timer.min_s = min_s
