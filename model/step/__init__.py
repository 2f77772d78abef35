"""The diffusion step: ``DiffusionStep`` (one rank's step, model/step/step.py), ``BatchedStep`` (many
sessions in one forward, model/step/batched.py) and their ``StepOptions`` (model/step/options.py).

The names load on first use (PEP 562): the config imports ``StepOptions`` without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from charstream.model.step.options import StepOptions

if TYPE_CHECKING:
    from charstream.model.step.batched import BUCKETS, BatchedStep
    from charstream.model.step.step import DiffusionStep

_LAZY = {"DiffusionStep": "step", "BatchedStep": "batched", "BUCKETS": "batched"}
__all__ = ["BUCKETS", "BatchedStep", "DiffusionStep", "StepOptions"]


def __getattr__(name: str) -> object:
    if name in _LAZY:
        return getattr(importlib.import_module(f"charstream.model.step.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
