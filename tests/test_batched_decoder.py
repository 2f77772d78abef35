"""Cross-session batching of the decoder at the model level (model/batched_decoder.py): sessions decoded
in one forward equal each session decoding alone -- sessions joining, leaving, one continuing from an
older state (a rollback), a newcomer's zero history beside others' -- bit for bit on CPU (frames and the
float history); on CUDA within a stated tolerance of ``GraphedDecoder`` alone, the graphs equal eager,
and the stage's ``DecodeBatcher`` serves sessions there. Imports torch and the model only (it runs on a
GPU host without the serving stack's wheels)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from charstream.model.batched_decoder import BatchedDecoder
from charstream.model.config import TINY
from charstream.model.vae import CausalState, Decoder, to_uint8_frames
from charstream.stages.config import DecodeConfig
from charstream.stages.decode.batcher import DecodeBatcher

# -- the batched decoder (model level) ----------------------------------------------------------------

# a small decoder (4 x 4 latent): without vae.conv_per_clip its batch of clips differs from each alone
SMALL = TINY.with_(height=32, width=32, vae_channels=(32, 16, 8))


def _decoder(cfg=SMALL, seed: int = 5) -> Decoder:
    torch.manual_seed(seed)
    return Decoder(cfg).eval().requires_grad_(False)


def _latent(name: str, n: int, cfg=SMALL) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * ord(name) + n)
    return torch.randn(cfg.latent_channels, cfg.latent_height, cfg.latent_width, generator=g)


# Each forward: (sessions joining, sessions leaving, {session: chunk it continues after (a rollback)}, due).
SCRIPT = [
    (["a", "b"], [], {}, ["a", "b"]),
    (["c"], [], {}, ["a", "b", "c"]),  # 3 rows: padded to the bucket of 4 when graphed
    ([], [], {}, ["b", "c"]),  # a is not due this time
    ([], [], {"a": 0}, ["a", "b", "c"]),  # a rolls back: continues from its state after chunk 0
    ([], ["b"], {}, ["a", "c"]),
    (["d"], [], {}, ["a", "c", "d"]),  # a newcomer: zero history beside sessions with theirs
    ([], [], {}, ["a", "c", "d"]),
]


def _play(decode_one, decode_many, cfg=SMALL) -> dict[str, list[tuple[torch.Tensor, CausalState]]]:
    """Run SCRIPT: each session's frames and state per chunk decoded, one forward per entry (decode_many)
    or one call per session (decode_one)."""
    states: dict[str, list[CausalState | None]] = {}  # per session: the state after each chunk, None first
    out: dict[str, list] = {}
    for join, leave, rollbacks, due in SCRIPT:
        for name in leave:
            del states[name]
        for name in join:
            states[name], out[name] = [None], []
        for name, chunk in rollbacks.items():
            del states[name][chunk + 2 :]
        latents = [_latent(name, len(out[name]), cfg) for name in due]
        before = [states[name][-1] for name in due]
        if decode_many is not None:
            frames, after = decode_many(torch.stack(latents), before)
        else:
            frames, after = zip(*(decode_one(z, s) for z, s in zip(latents, before, strict=True)), strict=True)
        for name, f, s in zip(due, frames, after, strict=True):
            out[name].append((f.cpu().clone(), s))
            states[name].append(s)
    return out


def _alone(decoder: Decoder):
    def one(latent, state):
        video, state = decoder.decode_chunk(latent, state)
        return to_uint8_frames(video), state

    return one


def test_batched_sessions_decode_as_each_alone_bit_for_bit_on_cpu():
    decoder = _decoder()
    with torch.inference_mode():
        alone = _play(_alone(decoder), None)
        batch = BatchedDecoder(decoder, max_sessions=4)
        batched = _play(None, batch.decode)
    for name, chunks in alone.items():
        assert len(batched[name]) == len(chunks)
        for (got_f, got_s), (want_f, want_s) in zip(batched[name], chunks, strict=True):
            assert torch.equal(got_f, want_f), name
            assert got_s.frames == want_s.frames
            for g, w in zip(got_s.caches, want_s.caches, strict=True):
                assert torch.equal(g, w), name  # the float history too, not only the rounded frames
    # the script has teeth: a's rollback changed what its chunk 3 continued from, sessions differ
    assert [s.frames for _, s in alone["a"]] == [1, 2, 2, 3, 4, 5] and not torch.equal(alone["a"][0][0], alone["b"][0][0])


def test_the_batched_decoder_refuses_bad_batches_before_anything_moves():
    decoder = _decoder()
    batch = BatchedDecoder(decoder, max_sessions=2)
    z = torch.stack([_latent("a", 0)])
    with torch.inference_mode():
        _, (state,) = batch.decode(z, [None])
    foreign = CausalState(tuple(c[..., :1] for c in state.caches), 1)
    with pytest.raises(ValueError, match="not a decoder state"):
        batch.decode(torch.cat([z, z]), [state, foreign])
    with pytest.raises(ValueError, match="1 to 2"):
        batch.decode(torch.cat([z, z, z]), [None, None, None])
    with pytest.raises(ValueError, match="a batch of 1 latent frames for 2 states"):
        batch.decode(z, [None, None])
    with pytest.raises(ValueError, match="CUDA"):
        BatchedDecoder(decoder, 2, graphed=True)



# -- CUDA ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_batched_decode_on_cuda_equals_each_alone_within_tolerance_and_the_graphs_equal_eager():
    """tiny's decoder in the GPU's serving form (bf16, channels-last). Alone: ``GraphedDecoder``, one
    session at a time; batched: one graphed forward per SCRIPT entry. cuDNN may choose another conv
    algorithm per batch size, and one bf16 rounding step of the output is half a uint8 level: frames
    within 8 levels, on average within 1, and 20x closer to alone than two sessions are to each other."""
    from charstream.model.graphed_decoder import GraphedDecoder

    cfg = TINY
    with torch.inference_mode():
        alone_dec = GraphedDecoder(_decoder(cfg).to("cuda"), torch.bfloat16)
        batch = BatchedDecoder(_decoder(cfg).to("cuda", torch.bfloat16), max_sessions=4, graphed=True)

    def one(latent, state):
        frames, state = alone_dec.decode_chunk(latent.to("cuda", torch.bfloat16), state)
        return frames.clone(), state

    alone = _play(one, None, cfg)
    batched = _play(None, batch.decode, cfg)
    diffs = torch.cat([(got.int() - want.int()).abs().flatten() for name, chunks in alone.items()
                       for (got, _), (want, _) in zip(batched[name], chunks, strict=True)]).float()
    apart = (alone["a"][0][0].float() - alone["b"][0][0].float()).abs().mean().item()  # two sessions
    print(f"batched vs alone on CUDA: worst {diffs.max().item():.0f} levels, mean {diffs.mean().item():.4f}, "
          f"{(diffs > 0).float().mean().item():.2e} of the values differ; two sessions differ by {apart:.2f} on average")
    assert diffs.max() <= 8 and diffs.mean() <= 1.0 and diffs.mean() * 20 < apart
    # graphed vs eager at the batch the graph ran (a full bucket: 4 sessions' rows, no padding)
    with torch.inference_mode():
        z = torch.stack([_latent(n, 0, cfg) for n in "wxyz"])
        g_frames, g_states = batch.decode(z, [None] * 4)
        g_frames = g_frames.clone()
        e_frames, e_states = batch.decode(z, [None] * 4, graphed=False)
    assert torch.equal(g_frames, e_frames)
    for g, e in zip(g_states, e_states, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(g.caches, e.caches, strict=True))
    assert not torch.equal(alone["a"][0][0], alone["b"][0][0])
    # and the stage's batcher serves sessions on CUDA (its own stream, frames back on the host)
    decode_batcher = DecodeBatcher(DecodeConfig(device="cuda", batch_sessions=4), "tiny", weights=None)

    async def two():
        keys = object(), object()
        for k in keys:
            await asyncio.to_thread(decode_batcher.join, k)
        z = [_latent(name, 0, cfg).numpy() for name in "ab"]
        got = await asyncio.gather(*(decode_batcher.decode(k, z[i], None) for i, k in enumerate(keys)))
        for k in keys:
            decode_batcher.leave(k)
        return got

    got = asyncio.run(two())
    assert [f.shape for f, _ in got] == [(4, 128, 128, 3)] * 2 and decode_batcher.stats.largest == 2
