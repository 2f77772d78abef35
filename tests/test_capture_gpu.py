"""Sessions sharing one process on a GPU (``charstream bench capacity``'s server workers): a session
captures its CUDA graphs while another keeps stepping, and nothing fails or changes (model/graphs.py).
Skipped without CUDA."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from charstream.model.config import TINY
from charstream.model.generator import Generator
from charstream.model.graphed_decoder import GraphedDecoder
from charstream.model.vae import Decoder

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _session(reference: torch.Tensor, audio: list[torch.Tensor]) -> list[torch.Tensor]:
    gen = Generator(TINY, None, "cuda", dtype=torch.bfloat16, fp8_cache=True, seed=3)
    gen.reset_session(reference)  # captures the step's graphs
    return [gen.step(a, seed=i).float().cpu() for i, a in enumerate(audio)]


def test_sessions_capture_their_graphs_while_another_session_steps():
    """One thread steps a running session without pause -- each latent copied to the host (a
    synchronisation) and a new buffer allocated per step -- while two new sessions and a decoder
    capture their graphs in threads of their own. In PyTorch's default (global) capture mode the
    other thread's allocations and synchronisations are errors during a capture."""
    g = torch.Generator().manual_seed(0)
    reference = torch.randn(TINY.latent_channels, TINY.latent_height, TINY.latent_width, generator=g)
    audio = [torch.randn(TINY.n_audio_tokens, TINY.audio_dim, generator=g) for _ in range(8)]
    alone = _session(reference, audio)

    running = Generator(TINY, None, "cuda", dtype=torch.bfloat16, fp8_cache=True, seed=3)
    running.reset_session(reference)
    stop, errors, steps = threading.Event(), [], [0]

    def keep_stepping() -> None:
        try:
            while not stop.is_set():
                i = steps[0]
                running.step(audio[i % len(audio)], seed=i).float().cpu()
                torch.empty((i % 64 + 1) << 16, device="cuda")  # new sizes: the allocator asks CUDA for memory
                steps[0] += 1
        except Exception as e:  # reported by the assertion below
            errors.append(e)

    stepper = threading.Thread(target=keep_stepping)
    stepper.start()
    try:
        with ThreadPoolExecutor(3) as pool:
            sessions = [pool.submit(_session, reference, audio) for _ in range(2)]
            decoder = pool.submit(lambda: GraphedDecoder(Decoder(TINY).cuda()))
            results = [s.result(timeout=300) for s in sessions]
            decoder.result(timeout=300)
    finally:
        stop.set()
        stepper.join(timeout=60)
    assert not errors, errors
    assert steps[0] > 0
    for result in results:
        for got, want in zip(result, alone, strict=True):
            assert torch.equal(got, want)
