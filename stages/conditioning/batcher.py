"""The due audio encodes of one process's sessions run as one batch (``conditioning.batch_sessions`` > 1).

A FlashHead chunk's encode is wav2vec2 over an 8 s window and its adapter: a few milliseconds of GPU
work in some three hundred small launches. One session's conditioning stage launching them from its own
thread is cheap; sixteen sessions' threads launching them side by side under one GIL, beside the chunk
batchers' threads, made each wait ~160 ms for its tokens. The sessions of one serving process share the
family's encoder, so their due windows go through one ``encode_batch`` (the family's: the conditioner's
``encode_batch``) on the batcher's thread. The scheduling -- window, due set, bounded pending, worker
thread, failures -- is ``stages/shared/batcher.py``'s.

    batcher = EncodeBatcher(config.conditioning, conditioner.encode_batch)   # one per process: session_factory
    batcher.opened()                                   # a session's conditioning stage starts
    tokens = await batcher.submit(stage, window)       # float32 audio tokens, as ``encode`` returns them
    batcher.closed(stage)

On CUDA the batches run on a stream of the batcher's own, so their copies to the host wait for no chunk.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from charstream.stages.conditioning.stage import ENCODE_THREADS
from charstream.stages.config import ConditioningConfig
from charstream.stages.shared.batcher import SessionBatcher
from charstream.stages.shared.worker import use_own_stream


class EncodeBatcher(SessionBatcher):
    def __init__(self, config: ConditioningConfig, encode_batch: Callable[[list[np.ndarray]], list[np.ndarray]],
                 window_samples: int | None = None) -> None:
        """``window_samples``: the windows' length (None: any), so a wrong one fails its own session only,
        not the batch it would have joined."""
        self.device = config.device
        cuda = self.device.startswith("cuda")
        super().__init__(config.batch_sessions, config.batch_window_s, None if cuda else ENCODE_THREADS,
                         "encode-batcher")
        self.encode_batch = encode_batch
        self.window_samples = window_samples

    def check(self, key: Any, item: Any) -> None:
        shape = None if self.window_samples is None else (self.window_samples,)
        if not isinstance(item, np.ndarray) or item.dtype != np.int16 or item.ndim != 1 \
                or item.shape != (shape or item.shape):
            raise ValueError(f"an audio window is {self.window_samples or 'some'} int16 samples, got "
                             f"{type(item).__name__} {getattr(item, 'dtype', '')} {getattr(item, 'shape', '')}")

    def prepare(self) -> None:
        """On CUDA, the worker thread's own stream."""
        if self.device.startswith("cuda"):
            use_own_stream(self.device)

    def forward(self, keys: list[Any], items: list[Any]) -> list[Any]:
        return self.encode_batch(items)
