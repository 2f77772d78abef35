"""The ring-cache generator against the naive path: write-time RoPE/FP8, position reset, rollback,
bytes written per step, bad configs. Small variants of `tiny` (2 blocks, W=3, reset every 2 steps)
keep the suite fast while crossing several resets."""

from __future__ import annotations

import pytest
import torch

from charstream.kernels.fp8 import dequantize
from charstream.model.cache import KVCache
from charstream.model.config import TINY
from charstream.model.dit import DiT
from charstream.model.generator import Generator
from charstream.model.naive import NaiveGenerator
from charstream.model.rope import frame_positions
from charstream.model.sampler import seeded_noise
from charstream.model.tp import apply_tp

CFG = TINY.with_(n_blocks=2, height=64, width=64, window_frames=3, reset_every=2, rollback_frames=2)
STEPS = 8  # positions reset before frames 5 and 7


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _inputs(seed: int, steps: int = STEPS) -> tuple[torch.Tensor, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    ref = torch.randn(CFG.latent_channels, CFG.latent_height, CFG.latent_width, generator=g)
    audio = [torch.randn(CFG.n_audio_tokens, CFG.audio_dim, generator=g) for _ in range(steps)]
    return ref, audio


def _run(gen, ref: torch.Tensor, audio: list[torch.Tensor]) -> list[torch.Tensor]:
    """What each step added to its seeded starting noise (the noise itself is identical across runs)."""
    gen.reset_session(ref)
    shape = (CFG.latent_channels, CFG.latent_height, CFG.latent_width)
    return [gen.step(a, seed=100 + i) - seeded_noise(shape, 100 + i) for i, a in enumerate(audio)]


def _context_heavy(gen: Generator) -> Generator:
    """Random weights barely use their context; sharpen attention and amplify its output so that the
    step output depends strongly on the cache -- the comparisons below then have teeth."""
    hd = CFG.n_heads * CFG.head_dim
    for block in gen.model.blocks:
        block.q_norm.weight.mul_(3.0)
        block.k_norm.weight.mul_(3.0)
        block.w_out.weight[:, :hd].mul_(8.0)
        block.w_out.weight[:, 2 * hd :].mul_(0.25)  # quieter MLP
    return gen


def _generator(fp8: bool, **kwargs) -> Generator:
    return _context_heavy(Generator(CFG, fp8_cache=fp8, seed=3, **kwargs))


@pytest.fixture(scope="module")
def naive_outputs() -> dict:
    gen = _generator(False)
    ref, audio = _inputs(0)
    naive = NaiveGenerator(gen.model)
    out = _run(naive, ref, audio)
    # How much the output depends on the context at all: the same steps under another reference frame.
    other = _run(NaiveGenerator(gen.model), _inputs(1)[0], audio)
    sensitivity = min(_rel(o, n) for o, n in zip(other, out, strict=True))
    return {"model": gen.model, "ref": ref, "audio": audio, "out": out, "naive": naive, "sensitivity": sensitivity}


@pytest.mark.parametrize("fp8", [False, True])
def test_ring_cache_matches_naive_path_across_position_resets(naive_outputs, fp8):
    gen = _generator(fp8)
    out = _run(gen, naive_outputs["ref"], naive_outputs["audio"])
    assert gen.cache.offset == 4  # two resets happened
    errors = [_rel(o, n) for o, n in zip(out, naive_outputs["out"], strict=True)]
    sensitivity = naive_outputs["sensitivity"]
    assert sensitivity > 0.01  # the outputs really depend on the cached context
    if fp8:
        # e4m3 keeps 3 mantissa bits (rounding <= 6.25% per value); stated tolerance: 1% relative
        # error of each step's output, and under a third of what a different context changes
        assert max(errors) < min(0.01, 0.3 * sensitivity), (errors, sensitivity)
        assert gen.cache.saturated.item() == 0
    else:
        assert max(errors) < 1e-5, errors


@pytest.mark.parametrize("fp8", [False, True])
def test_rotated_cache_equals_cache_rebuilt_at_shifted_positions(naive_outputs, fp8):
    gen = _generator(fp8)
    _run(gen, naive_outputs["ref"], naive_outputs["audio"])
    naive = naive_outputs["naive"]
    fresh = KVCache(CFG, CFG.n_heads, gen.cache.k.dtype, "cpu", gen.freqs)
    fresh.k_scale.copy_(gen.cache.k_scale)
    fresh.v_scale.copy_(gen.cache.v_scale)
    n, checked = gen.next_frame, []
    for f in range(n - CFG.window_frames, n):  # the frames the next step attends to
        fresh.write_start = CFG.sink_frames * CFG.tokens_per_step + (f % CFG.ring_frames) * CFG.tokens_per_step
        positions = frame_positions(CFG.sink_frames + f - gen.cache.offset, CFG.grid, CFG.n_audio_tokens)
        for layer in range(CFG.n_blocks):
            fresh.write(layer, naive.history[f][0][layer], naive.history[f][1][layer], positions)
        checked.append(slice(fresh.write_start, fresh.write_start + CFG.tokens_per_step))
    scale = gen.cache.k_scale[..., None, None]
    for slots in checked:
        rotated = dequantize(gen.cache.k[:, :, slots], scale)
        rebuilt = dequantize(fresh.k[:, :, slots], scale)
        # FP8: the rotation requantizes, so up to one e4m3 rounding step per value (~3% of it)
        assert _rel(rotated, rebuilt) < (0.04 if fp8 else 1e-5)


@pytest.mark.parametrize("fp8", [False, True])
def test_rollback_then_regenerate_equals_never_generating(naive_outputs, fp8):
    ref, audio = naive_outputs["ref"], naive_outputs["audio"]
    speech = [torch.randn(CFG.n_audio_tokens, CFG.audio_dim) for _ in range(2)]
    straight = _generator(fp8)
    _run(straight, ref, audio[:4])
    expected = [straight.step(a, seed=104 + i) for i, a in enumerate(speech)]

    gen = _generator(fp8)
    _run(gen, ref, audio[:6])  # idles on frames 4 and 5 (a reset happened before frame 5)
    assert gen.rollback(2) == 0  # within the rollback margin: exact
    again = [gen.step(a, seed=104 + i) for i, a in enumerate(speech)]
    assert gen.next_frame == 6
    # the rollback undid the reset before frame 5 (a rotation back), so the context went through two
    # extra rotations: equal up to rounding (fp32) or requantization (FP8, tolerance as above)
    for i, (a, b) in enumerate(zip(again, expected, strict=True)):
        noise = seeded_noise(a.shape, 104 + i)
        assert _rel(a - noise, b - noise) < (1e-5 if not fp8 else 0.01)


@pytest.mark.parametrize("fp8", [False, True])
def test_rollback_without_a_reset_is_bit_exact(naive_outputs, fp8):
    ref, audio = naive_outputs["ref"], naive_outputs["audio"]
    speech = torch.randn(CFG.n_audio_tokens, CFG.audio_dim)
    straight = _generator(fp8)
    _run(straight, ref, audio[:3])
    expected = straight.step(speech, seed=7)
    gen = _generator(fp8)
    _run(gen, ref, audio[:5])  # frames 3 and 4, no position reset among them
    assert gen.rollback(2) == 0
    assert torch.equal(gen.step(speech, seed=7), expected)


def test_rollback_beyond_the_margin_reports_lost_context():
    gen = _generator(False)
    ref, audio = _inputs(2)
    _run(gen, ref, audio[:7])
    # the ring holds 5 frames (W=3 + 2): back at frame 3 the window wants frames 1 and 2, and
    # frame 1's ring position now holds frame 6
    assert gen.rollback(4) == 1
    assert gen.next_frame == 3
    with pytest.raises(ValueError, match="cannot roll back"):
        gen.rollback(4)


@pytest.mark.parametrize("fp8", [False, True])
def test_step_writes_only_the_new_slots_in_place(fp8):
    gen = _generator(fp8)
    ref, audio = _inputs(3)
    gen.reset_session(ref)
    pointers = (gen.cache.k.data_ptr(), gen.cache.v.data_ptr())
    t = CFG.tokens_per_step
    for i, a in enumerate(audio[:4]):  # no position reset in these steps
        before_k, before_v = gen.cache.k.view(torch.uint8).clone(), gen.cache.v.view(torch.uint8).clone()
        gen.step(a, seed=i)
        start = CFG.sink_frames * t + i * t
        for before, now in ((before_k, gen.cache.k), (before_v, gen.cache.v)):
            changed = (before != now.view(torch.uint8)).flatten(3).any(-1).any(0).any(0)  # per slot
            slots = changed.nonzero().flatten()
            assert slots.min() >= start and slots.max() < start + t
            assert changed[start : start + t].float().mean() > 0.9  # and the new frame really was written
    assert (gen.cache.k.data_ptr(), gen.cache.v.data_ptr()) == pointers


def test_bad_configs_fail_at_construction_with_clear_messages():
    with pytest.raises(ValueError, match="not divisible by the tensor-parallel size 5"):
        apply_tp(DiT(CFG), 0, 5)
    with pytest.raises(ValueError, match="cannot hold 1 sink \\+ 3 window"):
        Generator(CFG, cache_slots=CFG.storage_slots - 1)
    with pytest.raises(ValueError, match="audio_rate 44100 Hz must divide"):
        DiT(CFG.with_(audio_rate=44_100))
    with pytest.raises(ValueError, match="noise_levels"):
        Generator(CFG.with_(noise_levels=(1.0, 0.5, 0.75, 0.25)))
    gen = Generator(CFG)
    with pytest.raises(RuntimeError, match="before reset_session"):
        gen.step(torch.zeros(CFG.n_audio_tokens, CFG.audio_dim), seed=0)
    gen.reset_session(torch.zeros(CFG.latent_channels, CFG.latent_height, CFG.latent_width))
    with pytest.raises(ValueError, match="audio tokens have shape"):
        gen.step(torch.zeros(CFG.n_audio_tokens + 1, CFG.audio_dim), seed=0)


def test_fp8_values_beyond_the_sink_range_saturate_and_are_counted():
    gen = _generator(True)
    ref, _ = _inputs(4)
    gen.reset_session(ref)
    cache = gen.cache
    assert cache.saturated.item() == 0
    _, t = cache.begin_frame()
    positions = frame_positions(t, CFG.grid, CFG.n_audio_tokens)
    shape = (CFG.tokens_per_step, CFG.n_heads, CFG.head_dim)
    limit_v = (cache.v_scale[0] * 448.0)[None, :, None]
    v = (torch.rand(shape, generator=torch.Generator().manual_seed(5)) - 0.5) * limit_v  # inside the range
    v[0, :, 0] = 3 * limit_v[0, :, 0]  # one value per head, 3x beyond the range the sink fixed
    cache.write(0, torch.zeros(shape), v, positions)
    assert cache.saturated.item() == CFG.n_heads
    stored = dequantize(cache.v[0, :, cache.write_start], cache.v_scale[0][:, None])
    assert torch.isfinite(stored).all()
    torch.testing.assert_close(stored[:, 0], limit_v[0, :, 0])  # clamped to +448 x scale, not NaN
