"""Cross-session batching at the model level (model/step/batched.py ``BatchedStep``): sessions stepped in one
forward equal the same sessions stepping alone -- with their own seeds and audio, one rolling back,
positions resetting in some sessions and not others, sessions joining and leaving (a lane reused),
and batches padded to a bucket. A small `tiny` variant (reset every 2 steps) crosses resets quickly."""

from __future__ import annotations

import pytest
import torch

from charstream.kernels.fp8 import FP8_DTYPE
from charstream.kernels.rope import rope_freqs
from charstream.model.cache import KVCache
from charstream.model.config import TINY
from charstream.model.dit import DiT
from charstream.model.step import BatchedStep, DiffusionStep, StepOptions

CFG = TINY.with_(n_blocks=2, height=64, width=64, window_frames=3, reset_every=2, rollback_frames=2)


def _model() -> DiT:
    """Random weights whose output depends strongly on the ring (sharp attention, loud attention branch)."""
    model = DiT(CFG).init_random_(3).eval()
    hd = CFG.n_heads * CFG.head_dim
    with torch.no_grad():
        for block in model.blocks:
            block.q_norm.weight.mul_(3.0)
            block.k_norm.weight.mul_(3.0)
            block.w_out.weight[:, :hd].mul_(8.0)
    return model


def _reference(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash(name) % 1000)
    return torch.randn(CFG.latent_channels, CFG.latent_height, CFG.latent_width, generator=g)


def _audio(name: str, frame: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * (hash(name) % 1000) + frame)
    return torch.randn(CFG.n_audio_tokens, CFG.audio_dim, generator=g)


# Each batch: (sessions joining, sessions leaving, rollbacks {name: k}, sessions due). Frames differ per
# session, so position resets (before frames 5, 7, ...) fall in different batches for different sessions.
SCRIPT = [
    (["a", "b"], [], {}, ["a", "b"]),
    ([], [], {}, ["a", "b"]),
    (["c"], [], {}, ["a", "b", "c"]),  # 3 rows: padded to the bucket of 4
    ([], [], {"a": 2}, ["a", "b", "c"]),  # a regenerates 2 frames
    ([], [], {}, ["b", "c"]),  # a is not due this time
    ([], [], {}, ["a", "b", "c"]),
    ([], ["b"], {}, ["a", "c"]),
    (["d"], [], {"c": 1}, ["a", "c", "d"]),  # d takes b's lane
    ([], [], {}, ["a", "c", "d"]),
    ([], [], {}, ["d"]),
    ([], [], {}, ["a", "c", "d"]),
]


def _play(model: DiT, kv_dtype: torch.dtype, batched: bool, graphed: bool = False) -> tuple[dict, dict]:
    """Run SCRIPT batched (one BatchedStep) or alone (a DiffusionStep per session with a cache of its
    own); returns each session's latents in order and the resets each batch applied."""
    dev = model.head.weight.device
    batch = BatchedStep(model, max_sessions=4, kv_dtype=kv_dtype, options=StepOptions(graphed=graphed)) if batched else None
    freqs = rope_freqs(CFG.head_dim, dev)
    steps: dict[str, DiffusionStep] = {}
    out: dict[str, list[torch.Tensor]] = {}
    resets: dict[int, list[str]] = {}
    for i, (join, leave, rollbacks, due) in enumerate(SCRIPT):
        for name in leave:
            if batch is not None:
                batch.close(steps[name])
            del steps[name]
        for name in join:
            steps[name] = batch.open() if batch else DiffusionStep(model, KVCache(CFG, CFG.n_heads, kv_dtype, dev, freqs),
                                                                     options=StepOptions(fused=False))
            steps[name].reset_session(_reference(name))
            out[name] = []
        for name, k in rollbacks.items():
            assert steps[name].rollback(k) == 0
        offsets = {name: steps[name].cache.offset for name in due}
        audio = [_audio(name, steps[name].next_frame) for name in due]
        seeds = [hash((name, steps[name].next_frame)) % 2**31 for name in due]
        if batch is not None:
            latents = batch.step([steps[name] for name in due], audio, seeds)
        else:
            latents = [steps[name].step(a, s) for name, a, s in zip(due, audio, seeds, strict=True)]
        for name, latent in zip(due, latents, strict=True):
            out[name].append(latent.clone())
        resets[i] = [name for name in due if steps[name].cache.offset != offsets[name]]
    return out, resets


@pytest.mark.parametrize("kv_dtype", [torch.float32, FP8_DTYPE], ids=["fp32", "fp8"])
def test_batched_sessions_equal_each_session_alone(kv_dtype):
    model = _model()
    alone, resets = _play(model, kv_dtype, batched=False)
    batched, batched_resets = _play(model, kv_dtype, batched=True)
    assert batched_resets == resets
    # the script has teeth: some batch holds a session crossing a position reset beside one that does not
    assert any(0 < len(names) < len(SCRIPT[i][3]) for i, names in resets.items())
    for name, frames in alone.items():
        assert len(batched[name]) == len(frames)
        for got, want in zip(batched[name], frames, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)  # bit for bit on CPU
    # and sessions differ from each other (their own references, audio and seeds)
    assert not torch.allclose(alone["a"][0], alone["b"][0], atol=1e-2)


def test_a_batch_takes_distinct_open_sessions_and_a_full_pool_refuses():
    model = _model()
    batch = BatchedStep(model, max_sessions=2, kv_dtype=torch.float32)
    a, b = batch.open(), batch.open()
    with pytest.raises(RuntimeError, match="holds 2 sessions"):
        batch.open()
    audio = _audio("a", 0)
    with pytest.raises(RuntimeError, match="before reset_session"):
        batch.step([a], [audio], [0])
    a.reset_session(_reference("a"))
    with pytest.raises(ValueError, match="distinct open sessions"):
        batch.step([a, a], [audio, audio], [0, 1])
    with pytest.raises(ValueError, match="audio tokens have shape"):
        batch.step([a], [audio[:1]], [0])
    assert a.next_frame == 0  # a refused batch moves nothing
    batch.close(b)
    with pytest.raises(ValueError, match="distinct open sessions"):
        batch.step([a, b], [audio, audio], [0, 1])
    assert batch.step([a], [audio], [0]).shape == (1, CFG.latent_channels, CFG.latent_height, CFG.latent_width)
    assert batch.open().cache.lane == 1  # b's lane, reused


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_batched_sessions_on_cuda_equal_each_alone_and_the_graphs_equal_eager():
    """The GPU's serving dtypes (bf16 model, FP8 ring). Alone, the module body writes and attends
    through the Triton kernels (RoPE in fp32 trig in the kernel); batched, through plain PyTorch --
    equal within FP8 rounding of the keys, far below what separates two sessions."""
    model = _model().to("cuda", torch.bfloat16)
    alone, resets = _play(model, FP8_DTYPE, batched=False)
    eager, eager_resets = _play(model, FP8_DTYPE, batched=True)
    graphed, _ = _play(model, FP8_DTYPE, batched=True, graphed=True)
    assert eager_resets == resets
    worst, replay_worst, exact, frames_seen = 0.0, 0.0, 0, 0
    for name, frames in alone.items():
        for got, want, replayed in zip(eager[name], frames, graphed[name], strict=True):
            worst = max(worst, _rel(got, want))
            replay_worst = max(replay_worst, (replayed - got).abs().max().item())
            exact += torch.equal(replayed, got)
            frames_seen += 1
    separation = _rel(alone["a"][0], alone["b"][0])
    print(f"batched vs alone on CUDA: worst relative error {worst:.2e} (two sessions: {separation:.2e}); "
          f"graphed vs eager: {exact}/{frames_seen} frames bit-identical, worst abs {replay_worst:.2e}")
    assert replay_worst < 1e-5, replay_worst  # one graph per bucket replays the eager body
    assert worst < 5e-2, worst
    assert separation > 0.2, separation
