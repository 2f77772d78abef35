"""Where a session's processes run on one host: diffusion TP ranks and the decoder, by GPU.

A layout is named ``<tp>+<decoders>``: ``3+1`` is the reference's most likely 4-GPU session (TP=3
diffusion + a decoder GPU), ``3`` shares the last diffusion GPU with the decoder, ``6+1`` uses an
8-GPU host (60 heads do not split 7 ways; the eighth GPU stays free for a second session's decoder).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from charstream.model.families import get_family
from charstream.pipeline.config import PipelineConfig


@dataclass(frozen=True)
class Layout:
    name: str
    diffusion: tuple[str, ...]  # one device per TP rank
    decoder: str

    @property
    def tp(self) -> int:
        return len(self.diffusion)

    @property
    def gpus(self) -> int:
        return len({d for d in (*self.diffusion, self.decoder) if d.startswith("cuda")})


def _cuda(first: int, count: int) -> tuple[str, ...]:
    return tuple(f"cuda:{i}" for i in range(first, first + count))


LAYOUTS: dict[str, Layout] = {
    p.name: p
    for p in (
        Layout("cpu", ("cpu",), "cpu"),
        Layout("1", _cuda(0, 1), "cuda:0"),
        Layout("1+1", _cuda(0, 1), "cuda:1"),
        Layout("2+1", _cuda(0, 2), "cuda:2"),
        Layout("3", _cuda(0, 3), "cuda:2"),
        Layout("3+1", _cuda(0, 3), "cuda:3"),
        Layout("4+1", _cuda(0, 4), "cuda:4"),
        Layout("6+1", _cuda(0, 6), "cuda:6"),
    )
}


def apply_layout(config: PipelineConfig, name: str, gpus_available: int | None = None) -> PipelineConfig:
    """A copy of ``config`` with the layout's devices; diffusion and decode in their own processes, except
    for a model that generates whole chunks (FlashHead): its diffusion and decode share one chunk stream,
    so they stay in the session's process (``stages/diffusion/chunks.py``), on one GPU."""
    try:
        layout = LAYOUTS[name]
    except KeyError:
        raise ValueError(f"unknown layout {name!r}; known: {', '.join(LAYOUTS)}") from None
    if gpus_available is not None and layout.gpus > gpus_available:
        raise ValueError(f"layout {name!r} needs {layout.gpus} GPUs, this host has {gpus_available}")
    diffusion = dataclasses.replace(config.diffusion, tp=layout.tp, device=layout.diffusion[0],
                                    devices=list(layout.diffusion), fp8_cache=layout.decoder != "cpu")
    decode = dataclasses.replace(config.decode, device=layout.decoder)
    # The audio encoder beside the decoder: on the edge's CPU, among egress and playout, a 14b chunk's
    # encode took 47-155 ms on the H200 host (docs/PERF.md), a wait every turn's first chunk pays.
    conditioning = dataclasses.replace(config.conditioning, device=layout.decoder)
    chunked = get_family(config.preset).generation_mode == "chunk_motion"
    if chunked and layout.tp > 1:
        raise ValueError(f"layout {name!r}: model {config.preset!r} runs on one GPU (layout 1)")
    if not chunked:
        config.model.validate(layout.tp)  # heads and ffn must split over the ranks
    hosting = "inproc" if name == "cpu" or chunked else "processes"
    return dataclasses.replace(config, conditioning=conditioning, diffusion=diffusion, decode=decode,
                               hosting=hosting)
