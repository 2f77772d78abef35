"""The due audio encodes of one process's sessions run as one batch (``conditioning.batch_sessions`` > 1).

A FlashHead chunk's encode is wav2vec2 over an 8 s window and its adapter: a few milliseconds of GPU
work in many small launches. One session's conditioning stage launching them from its own
thread is cheap; sixteen sessions' threads launching them side by side under one GIL, beside the chunk
batchers' threads, made each wait ~160 ms for its tokens. The sessions of one serving process share the
family's encoder, so their due windows go through its conditioner's one ``encode_batch`` on the
batcher's thread. The scheduling -- window, due set, bounded pending, worker
thread, failures -- is ``stages/shared/batcher.py``'s.

    batcher = EncodeBatcher(config.conditioning, conditioner, family.timeline)   # one per process: session_factory
    batcher.opened()                                   # a session's conditioning stage starts
    tokens = await batcher.submit(stage, window)       # float32 audio tokens, as ``encode`` returns them
    batcher.closed(stage)

On CUDA the batches run on a stream of the batcher's own, of the highest priority, so their kernels and
copies to the host wait for no chunk's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from charstream.stages.conditioning.stage import ENCODE_THREADS
from charstream.stages.config import ConditioningConfig
from charstream.stages.shared.batcher import SessionBatcher
from charstream.stages.shared.worker import use_own_stream

if TYPE_CHECKING:
    from charstream.model.families.base import AudioConditioner
    from charstream.timeline import Timeline


class EncodeBatcher(SessionBatcher):
    def __init__(self, config: ConditioningConfig, conditioner: AudioConditioner, timeline: Timeline) -> None:
        """``conditioner``: the family's, with ``encode_batch``; its windows for chunks of ``timeline``."""
        if conditioner.encode_batch is None:
            raise ValueError("this model's conditioner encodes one window at a time: no encode batcher")
        self.device = config.device
        cuda = self.device.startswith("cuda")
        super().__init__(config.batch_sessions, config.batch_window_s, None if cuda else ENCODE_THREADS,
                         "encode-batcher")
        self.encode_batch = conditioner.encode_batch
        self.window_samples = conditioner.window_samples(timeline)

    def check(self, key: Any, item: Any) -> None:
        """A window the batch cannot take fails its own session, not the batch it would have joined."""
        if not isinstance(item, np.ndarray) or item.dtype != np.int16 or item.shape != (self.window_samples,):
            raise ValueError(f"an audio window is {self.window_samples} int16 samples, got "
                             f"{type(item).__name__} {getattr(item, 'dtype', '')} {getattr(item, 'shape', '')}")

    def prepare(self) -> None:
        """On CUDA, the worker thread's own stream, urgent as a session's own encodes are."""
        if self.device.startswith("cuda"):
            use_own_stream(self.device, urgent=True)

    def forward(self, keys: list[Any], items: list[Any]) -> list[Any]:
        return self.encode_batch(items)
