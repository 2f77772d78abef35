"""The diffusion step's fused body, eager and CUDA-graphed, against the module body, alone and under
TP (NCCL at world size 1: the collectives inside the graph), and the graphed decoder against the
eager one (tiny preset, GPU). Skipped without CUDA."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist

from charstream.kernels.fp8 import FP8_DTYPE
from charstream.model.config import TINY
from charstream.model.generator import Generator
from charstream.model.graphed_decoder import GraphedDecoder
from charstream.model.sampler import seeded_noise
from charstream.model.step import StepOptions
from charstream.model.vae import Decoder, to_uint8_frames

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _generator(cfg=TINY, tp_group=None, **options) -> Generator:
    # the same seeded random weights in every generator of a test
    return Generator(cfg, None, "cuda", tp_group, dtype=torch.bfloat16, fp8_cache=True, seed=3,
                     options=StepOptions(**options))


@pytest.mark.parametrize("context_frames", [2, TINY.window_frames + 2])
def test_fused_step_matches_module_body_and_graph_matches_eager(context_frames):
    """2 frames of context: in-place ring attention; a full window: the gathered (cuDNN) attention."""
    shape = (TINY.latent_channels, TINY.latent_height, TINY.latent_width)
    g = torch.Generator().manual_seed(0)
    reference = torch.randn(shape, generator=g)
    audio = [torch.randn(TINY.n_audio_tokens, TINY.audio_dim, generator=g) for _ in range(context_frames + 1)]
    out, keys = {}, {}
    for mode in ("module", "eager", "graphed"):
        gen = _generator(fused=mode != "module", graphed=mode == "graphed")
        gen.reset_session(reference)
        if mode == "graphed":
            assert len(gen.diffusion.graphs) == 2  # ring and gathered backends, captured at the reset
        out[mode] = [gen.step(a, seed=s) for s, a in enumerate(audio)]
        if mode != "module":
            full = context_frames >= TINY.window_frames
            assert gen.diffusion.attention.name == ("gathered" if full else "ring")
        keys[mode] = gen.cache.k
        assert gen.cache.k.dtype == FP8_DTYPE
    for got, want in zip(out["graphed"], out["eager"], strict=True):
        assert torch.equal(got, want)
    assert torch.equal(keys["graphed"].view(torch.uint8), keys["eager"].view(torch.uint8))
    # FP8 weights and activations against the module's bf16 GEMMs: a few % on what the model adds
    noise = seeded_noise(shape, context_frames).cuda()
    assert _rel(out["eager"][-1] - noise, out["module"][-1] - noise) < 0.05
    assert _rel(keys["eager"].float(), keys["module"].float()) < 0.1


def _session(gen: Generator, audio: list[torch.Tensor]) -> list[torch.Tensor]:
    """10 steps, a rollback of 3, 7 more: with reset_every=2, position resets before and after it."""
    gen.reset_session(torch.randn(gen.cfg.latent_channels, gen.cfg.latent_height, gen.cfg.latent_width,
                                  generator=torch.Generator().manual_seed(1)))
    out = [gen.step(audio[i], i) for i in range(10)]
    assert gen.rollback(3) == 0
    out += [gen.step(audio[i], 100 + i) for i in range(7, 14)]
    assert gen.cache.offset > 0  # position resets happened
    return out


def test_graphed_step_stays_valid_across_rollback_and_position_reset():
    """One capture serves a whole session: graph replays equal the eager fused step through a
    rollback and position resets (delta rotations outside the graph)."""
    cfg = TINY.with_(reset_every=2)
    audio = [torch.randn(cfg.n_audio_tokens, cfg.audio_dim) for _ in range(14)]
    graphed = _session(_generator(cfg, fused=True, graphed=True), audio)
    eager = _session(_generator(cfg, fused=True, graphed=False), audio)
    for got, want in zip(graphed, eager, strict=True):
        assert torch.equal(got, want)


def test_gathered_window_mirrors_the_ring_through_rollback_and_position_reset():
    """The bf16 window that each pass's ring write keeps current equals the window gathered afresh
    from the ring after every full-window step, through a rollback and position resets (which make the
    step gather it again)."""
    from charstream.kernels.ring_attention import gather_window

    cfg = TINY.with_(reset_every=2)
    gen = _generator(cfg, fused=True, graphed=True)
    step, cache, n_window = gen.diffusion, gen.cache, cfg.window_frames
    window = step.full_window.window
    gen.reset_session(torch.randn(cfg.latent_channels, cfg.latent_height, cfg.latent_width))
    checked = 0
    for i in [*range(10), "rollback", *range(7, 14)]:
        if i == "rollback":
            assert gen.rollback(3) == 0
            continue
        gen.step(torch.randn(cfg.n_audio_tokens, cfg.audio_dim), i)
        if step.attention is not step.full_window:
            continue
        newest = cache.next_frame - 1
        frames = sorted(range(newest - n_window + 1, newest + 1), key=lambda f: f % n_window)
        order = torch.tensor([f % cache.ring_frames for f in frames], dtype=torch.int32, device="cuda")
        fresh = tuple(torch.full_like(window.k[0], float("nan")) for _ in range(2))
        for layer in range(cfg.n_blocks):
            gather_window(cache.k[layer], cache.v[layer], cache.k_scale[layer], cache.v_scale[layer], order,
                          cache.sink_slots, cache.tokens_per_frame, fresh)
            assert torch.equal(fresh[0], window.k[layer]) and torch.equal(fresh[1], window.v[layer])
        checked += 1
    assert checked >= 10 and cache.offset > 0


@pytest.mark.parametrize("splits", [1, 4])
def test_fp8_window_step_graph_matches_eager_and_stays_near_the_bf16_window(splits):
    """The FP8 window attention (cuDNN's FP8 SDPA over the ring's codes, head_dim 128 as cuDNN's FP8
    kernels take it), its keys in one partition or split 4 ways and merged (180 keys: 45 a partition):
    graph replays equal its eager fused step through a rollback and position resets (which regather the
    window and its scales), and its latents stay near the bf16 window's."""
    cfg = TINY.with_(dim=256, n_heads=2, head_dim=128, reset_every=2)
    audio = [torch.randn(cfg.n_audio_tokens, cfg.audio_dim) for _ in range(14)]
    graphed_gen = _generator(cfg, fused=True, graphed=True, attention="fp8_window", window_splits=splits)
    assert graphed_gen.diffusion.window_splits == splits
    graphed = _session(graphed_gen, audio)
    eager = _session(_generator(cfg, fused=True, graphed=False, attention="fp8_window", window_splits=splits), audio)
    bf16 = _session(_generator(cfg, fused=True, graphed=False), audio)
    for got, want in zip(graphed, eager, strict=True):
        assert torch.equal(got, want)
    # e4m3 queries, probabilities and output against bf16 ones, on what the model adds to the noise
    # (random weights: near-uniform attention, the FP8 path's worst case)
    for i, (got, want) in enumerate(zip(eager, bf16, strict=True)):
        noise = seeded_noise(got.shape, i if i < 10 else 100 + i - 3).to(got.device)
        assert _rel(got - noise, want - noise) < 0.1


def test_fp8_window_scales_follow_a_new_session():
    """A generator's second session (another reference, so other FP8 scales) steps exactly as a fresh
    generator's first: q's descale and multipliers and V's output scales are taken from the cache again
    when the new session's window is gathered, not kept from the first session."""
    cfg = TINY.with_(dim=256, n_heads=2, head_dim=128)
    shape = (cfg.latent_channels, cfg.latent_height, cfg.latent_width)
    g = torch.Generator().manual_seed(5)
    references = [torch.randn(shape, generator=g) * scale for scale in (1.0, 4.0)]
    audio = [torch.randn(cfg.n_audio_tokens, cfg.audio_dim, generator=g) for _ in range(cfg.window_frames + 3)]
    reused = _generator(cfg, fused=True, graphed=True, attention="fp8_window")
    reused.reset_session(references[0])
    for i, a in enumerate(audio):
        reused.step(a, i)
    first_scales = reused.cache.k_scale.clone()
    reused.reset_session(references[1])
    second = [reused.step(a, i) for i, a in enumerate(audio)]
    assert not torch.equal(reused.cache.k_scale, first_scales)  # the second session's scales differ
    fresh = _generator(cfg, fused=True, graphed=True, attention="fp8_window")
    fresh.reset_session(references[1])
    assert fresh.diffusion.attention is fresh.diffusion.ring
    for got, want in zip(second, [fresh.step(a, i) for i, a in enumerate(audio)], strict=True):
        assert torch.equal(got, want)
    assert fresh.diffusion.attention.name == "fp8_window"  # the last steps attended through the FP8 window


def test_graphed_step_under_tp_keeps_its_all_reduces_inside_the_graph(monkeypatch):
    """NCCL at world size 1 on the one GPU: the TP step's graph replays equal its eager runs and the
    step without a group, through a rollback and position resets; the eager step calls one
    all-reduce per block per pass, the graphed step none from Python (they replay in the graph)."""
    cfg = TINY.with_(reset_every=2)
    audio = [torch.randn(cfg.n_audio_tokens, cfg.audio_dim) for _ in range(14)]
    calls = []
    all_reduce = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        calls.append(tensor.shape)
        return all_reduce(tensor, *args, **kwargs)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            device_id=torch.device("cuda:0"))
    monkeypatch.setattr(dist, "all_reduce", counting)
    try:
        runs = {}
        for graphed in (True, False):
            gen = _generator(cfg, tp_group=dist.group.WORLD, fused=True, graphed=graphed)
            gen.reset_session(torch.zeros(cfg.latent_channels, cfg.latent_height, cfg.latent_width))
            calls.clear()
            gen.step(audio[0], 0)
            runs[graphed] = (len(calls), _session(gen, audio))
        alone = _session(_generator(cfg, fused=True, graphed=True), audio)
    finally:
        dist.destroy_process_group()
    assert runs[True][0] == 0
    assert runs[False][0] == 4 * cfg.n_blocks
    for graphed, eager, single in zip(runs[True][1], runs[False][1], alone, strict=True):
        assert torch.equal(graphed, eager)
        assert torch.equal(graphed, single)  # a one-rank all-reduce is the identity


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


def test_step_and_decoder_graphs_replay_concurrently_on_two_streams():
    """The pipelined period: step n + 1 replays on the main stream while chunk n's decoder graph
    replays on a second one -- each graph captured on a stream of its own, so their GEMMs use
    different cuBLAS workspaces -- and every latent and frame equals the one-at-a-time run."""
    audio = [torch.randn(TINY.n_audio_tokens, TINY.audio_dim) for _ in range(6)]
    reference = torch.randn(TINY.latent_channels, TINY.latent_height, TINY.latent_width)
    runs = {}
    for concurrent in (False, True):
        gen = _generator(fused=True, graphed=True)
        gen.reset_session(reference)
        torch.manual_seed(0)
        decoder = GraphedDecoder(Decoder(TINY).cuda())
        main, side = torch.cuda.current_stream(), torch.cuda.Stream()
        step, done, copied = gen.diffusion, torch.cuda.Event(), torch.cuda.Event()
        latents, frames = [], []
        for i, a in enumerate(audio):
            latents.append(step.step(a, seed=i))
            done.record(main)
            with torch.cuda.stream(side):
                side.wait_event(done)
                decoder.latent.copy_(latents[-1])
                copied.record(side)
                decoder.graph.replay()
                frames.append(decoder.frames.clone())
            main.wait_event(copied)
            if not concurrent:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        runs[concurrent] = latents, frames
    for a, b in zip(runs[True][0] + runs[True][1], runs[False][0] + runs[False][1], strict=True):
        assert torch.equal(a, b)
