"""The fused, CUDA-graphed step and decoder against the model's own eager paths (tiny preset, GPU).

Skipped without CUDA; run through the device tool (docs/gpu-notes.md)."""

from __future__ import annotations

import pytest
import torch
from charstream.kernels.fp8 import FP8_DTYPE
from charstream.model.config import TINY
from charstream.model.generator import Generator
from charstream.model.graphed_decoder import GraphedDecoder
from charstream.model.graphed_step import ShardStep
from charstream.model.sampler import seeded_noise
from charstream.model.vae import Decoder, to_uint8_frames

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


class _Saved:
    """The cache's whole state, to run one step several ways from the same start."""

    def __init__(self, cache) -> None:
        self.cache = cache
        self.tensors = [t.clone() for t in (cache.k, cache.v, cache.saturated, cache.ring_valid)]
        self.host = (list(cache.slot_frame), cache.offset, cache.next_frame)

    def restore(self) -> None:
        c = self.cache
        for dst, src in zip((c.k, c.v, c.saturated, c.ring_valid), self.tensors, strict=True):
            dst.copy_(src)
        c.slot_frame, c.offset, c.next_frame = list(self.host[0]), self.host[1], self.host[2]


@pytest.mark.parametrize("context_frames", [2, TINY.window_frames + 2])
def test_shard_step_matches_model_and_graph_matches_eager(context_frames):
    """2 frames of context: in-place ring attention; a full window: the gathered (cuDNN) attention."""
    gen = Generator(TINY, None, "cuda", dtype=torch.bfloat16, fp8_cache=True, seed=3)
    shape = (TINY.latent_channels, TINY.latent_height, TINY.latent_width)
    gen.reset_session(torch.randn(shape, device="cuda"))
    for s in range(context_frames):
        gen.step(torch.randn(TINY.n_audio_tokens, TINY.audio_dim, device="cuda"), seed=s)
    saved = _Saved(gen.cache)
    audio = torch.randn(TINY.n_audio_tokens, TINY.audio_dim, device="cuda")
    noise = seeded_noise(shape, 11).cuda()

    ref = gen.step(audio, 11)
    ref_k = gen.cache.k.clone()
    saved.restore()

    step = ShardStep(gen.model, gen.cache, prefer_gathered=True)
    step.capture()
    assert torch.equal(gen.cache.k.view(torch.uint8), saved.tensors[0].view(torch.uint8))  # capture left no trace
    eager = step.step(audio, 11, graphed=False)
    assert step.gathered == (context_frames >= TINY.window_frames)
    eager_k = gen.cache.k.clone()
    saved.restore()
    graphed = step.step(audio, 11, graphed=True)

    assert torch.equal(graphed, eager)
    assert torch.equal(gen.cache.k.view(torch.uint8), eager_k.view(torch.uint8))
    # FP8 weights and activations against the model's bf16 GEMMs: a few % on what the model adds
    assert _rel(eager - noise, ref - noise) < 0.05
    assert gen.cache.k.dtype == FP8_DTYPE
    pos = context_frames % gen.cache.ring_frames
    frame = slice(gen.cache.sink_slots + pos * gen.cache.tokens_per_frame, gen.cache.sink_slots + (pos + 1) * gen.cache.tokens_per_frame)
    assert _rel(eager_k[:, :, frame].float(), ref_k[:, :, frame].float()) < 0.1


def test_graphed_decoder_matches_eager_over_chunks():
    torch.manual_seed(0)
    eager = Decoder(TINY).cuda().to(dtype=torch.bfloat16, memory_format=torch.channels_last).eval()
    graphed = GraphedDecoder(Decoder(TINY).cuda())
    graphed.decoder.load_state_dict(eager.state_dict())
    state = None
    for _ in range(3):
        latent = torch.randn(TINY.latent_channels, TINY.latent_height, TINY.latent_width, device="cuda")
        with torch.inference_mode():
            video, state = eager.decode_chunk(latent.to(torch.bfloat16), state)
        want = to_uint8_frames(video).int()
        got = graphed.decode(latent).int()
        assert got.shape == want.shape == (TINY.frames_per_chunk, TINY.height, TINY.width, 3)
        assert (got - want).abs().max() <= 2 and (got != want).float().mean() < 0.01


def test_graphed_step_stays_valid_across_rollback_and_position_reset():
    """One capture serves a whole session: graph replays equal the eager fused step through a
    rollback and two position resets (delta rotations outside the graph)."""
    cfg = TINY.with_(reset_every=2)
    shape = (cfg.latent_channels, cfg.latent_height, cfg.latent_width)
    reference = torch.randn(shape, device="cuda")
    audio = [torch.randn(cfg.n_audio_tokens, cfg.audio_dim) for _ in range(14)]
    latents = {}
    for graphed in (True, False):
        gen = Generator(cfg, None, "cuda", dtype=torch.bfloat16, fp8_cache=True, seed=3)
        gen.reset_session(reference)
        step = ShardStep(gen.model, gen.cache, prefer_gathered=True)
        if graphed:
            step.capture()
        out = [step.step(audio[i], i, graphed=graphed) for i in range(10)]
        assert gen.rollback(3) == 0
        out += [step.step(audio[i], 100 + i, graphed=graphed) for i in range(7, 14)]
        assert gen.cache.offset > 0  # position resets happened
        latents[graphed] = out
    for got, want in zip(latents[True], latents[False], strict=True):
        assert torch.equal(got, want)


def test_graphed_decoder_decode_chunk_rolls_back_to_a_kept_state():
    torch.manual_seed(0)
    graphed = GraphedDecoder(Decoder(TINY).cuda())
    z = [torch.randn(TINY.latent_channels, TINY.latent_height, TINY.latent_width, device="cuda") for _ in range(3)]
    frames, states = [], [None]
    for latent in z:
        out, state = graphed.decode_chunk(latent, states[-1])
        frames.append(out.clone())
        states.append(state)
    assert states[-1].frames == 3
    again, _ = graphed.decode_chunk(z[1], states[1])  # rollback: chunk 1 again from the state after chunk 0
    assert torch.equal(again, frames[1])
    fresh, _ = graphed.decode_chunk(z[0], None)  # a new session: zero history
    assert torch.equal(fresh, frames[0])
