"""FlashHead's chunk stream on the CPU: a 2-block DiT at the real width and wav2vec2 with seeded random
weights loaded through their loaders (the released key spaces), the Wan VAE at a quarter of its channels
(its loader: test_flashhead_vae_wan.py), a 32 x 32 picture.

Asserts the chunk-motion contract: 28 new frames a chunk; the first chunk continues the portrait; every
later chunk's motion latents are the previous chunk's last 5 decoded frames, colour-matched to the
portrait and re-encoded (not zeros, not the portrait's); the audio tokens a chunk is given move it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from charstream.model.families import get_family
from charstream.model.families.flashhead.chunks import ChunkMotionStream, ChunkRunner, portrait_tensor
from charstream.model.families.flashhead.colour import colour_reference, match_colours
from charstream.model.families.flashhead.config import LITE, TEST
from charstream.model.families.flashhead.loader import load_dit
from charstream.model.families.flashhead.vae_ltx import random_ltx_vae
from charstream.model.families.flashhead.vae_wan import random_wan_vae

SMALL = TEST.with_(height=32, width=32, vae_width=0.25)  # a quarter of the VAE's channels: the same steps, 10x quicker


def portrait() -> np.ndarray:
    y, x = np.mgrid[0:48, 0:40]
    face = ((x - 20) ** 2 + (y - 22) ** 2 < 200)[..., None]
    return np.where(face, [210, 160, 130], [40, 60, 90]).astype(np.uint8)


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    return load_dit("random", "pro", seed=2, cfg=SMALL), random_wan_vae(5, width=SMALL.vae_width)


def test_chunks_continue_through_recoded_motion_latents(parts):
    dit, vae = parts
    torch.manual_seed(0)
    stream = ChunkMotionStream(dit, vae, portrait_tensor(portrait(), 32, 32), seed=4)
    assert stream.reference.shape == (1, 16, 9, 4, 4)
    first_motion = stream.motion.clone()
    # the first chunk continues the portrait from its first latent (as the released pipeline starts)
    assert torch.equal(first_motion, stream.reference[:, :, :1])
    tokens = np.random.default_rng(1).normal(size=(9, SMALL.audio_tokens, SMALL.dim)).astype(np.float32)

    latents = stream.denoise(tokens)
    assert torch.equal(latents[:, :, :1], first_motion)
    frames = stream.decode(latents)
    assert frames.shape == (28, 32, 32, 3) and frames.dtype == np.uint8
    # what is shown: the 28 new frames colour-matched to the portrait, as the released pipeline shows them
    decoded = vae.decode_chunk(latents)
    matched = match_colours(decoded[:, :, 5:].float(), colour_reference(portrait_tensor(portrait(), 32, 32)))
    shown = torch.from_numpy(frames).permute(3, 0, 1, 2).float() / 127.5 - 1
    assert (shown - matched[0]).abs().max() <= 1 / 127.5 + 1e-5
    assert (shown - decoded[0, :, 5:]).abs().max() > 0.05  # not the raw decode
    # the next motion: the chunk's last 5 frames, colour-matched to the portrait, re-encoded
    expected = vae.encode_motion(matched[:, :, -5:])
    torch.testing.assert_close(stream.motion, expected, rtol=1e-4, atol=1e-4)
    assert stream.motion.abs().mean() > 1e-3 and not torch.allclose(stream.motion, first_motion, atol=1e-3)

    second = stream.denoise(tokens)
    assert torch.equal(second[:, :, :2], stream.motion)  # chunk 2 starts where chunk 1 ended
    assert stream.decode(second).shape == (28, 32, 32, 3) and stream.chunks == 2


def test_audio_tokens_move_the_chunk_and_a_bad_portrait_is_refused(parts):
    dit, vae = parts
    rng = np.random.default_rng(2)
    tokens = [rng.normal(size=(9, SMALL.audio_tokens, SMALL.dim)).astype(np.float32) for _ in range(2)]
    chunks = [ChunkMotionStream(dit, vae, portrait_tensor(portrait(), 32, 32), seed=4).denoise(t) for t in tokens]
    assert (chunks[0][:, :, 2:] - chunks[1][:, :, 2:]).abs().mean() > 1e-4
    with pytest.raises(ValueError, match="RGB uint8"):
        portrait_tensor(np.zeros((8, 8), np.uint8), 32, 32)


def test_a_regenerated_chunk_continues_the_chunk_before_it_not_the_dropped_ones(parts):
    """After a rollback to chunk 1 (chunk 2 decoded, then dropped at playout), chunk 2 is made again from
    the motion latents chunk 1 left."""
    dit, vae = parts
    stream = ChunkMotionStream(dit, vae, portrait_tensor(portrait(), 32, 32), seed=4)
    tokens = np.random.default_rng(3).normal(size=(9, SMALL.audio_tokens, SMALL.dim)).astype(np.float32)
    left = {}
    for chunk in range(3):
        stream.decode(stream.denoise(tokens, chunk))
        left[chunk] = stream.motion.clone()
    assert not torch.allclose(left[1], left[2], atol=1e-3)
    again = stream.denoise(tokens, 2)
    assert torch.equal(again[:, :, :2], left[1])


def test_a_chunk_started_inside_the_last_one_continues_the_frames_shown_before_it(parts):
    """A re-phased turn start: a chunk made from a media frame inside a decoded chunk (its first 11 frames
    shown) takes its motion latents from the 5 frames shown before that frame, re-encoded; from frame 3 of
    the first chunk, the portrait stands for the two frames before the first; a chunk started where one
    ended takes the motion latents that one left; one whose frames are no longer kept continues the last."""
    dit, vae = parts
    stream = ChunkMotionStream(dit, vae, portrait_tensor(portrait(), 32, 32), seed=4)
    tokens = np.random.default_rng(3).normal(size=(9, SMALL.audio_tokens, SMALL.dim)).astype(np.float32)
    shown = [stream.decode(stream.denoise(tokens, 0))]
    ended = stream.motion.clone()
    shown.append(stream.decode(stream.denoise(tokens, 1)))

    def motion(chunk: int, start: int | None = None) -> torch.Tensor:
        stream.ready(chunk, start=start)
        stream.skip()  # nothing denoised: the next ready need not wait
        return stream.motion

    def encoded(frames: np.ndarray) -> torch.Tensor:
        return vae.encode_motion(torch.from_numpy(frames).permute(3, 0, 1, 2)[None].float() / 127.5 - 1)

    torch.testing.assert_close(motion(1, 28 + 11), encoded(shown[1][6:11]), rtol=1e-4, atol=1e-4)
    straddling = motion(1, 28 + 3)  # chunk 0's last 2 frames, then chunk 1's first 3
    torch.testing.assert_close(straddling, encoded(np.concatenate([shown[0][-2:], shown[1][:3]])), rtol=1e-4, atol=1e-4)
    portrait_pixels = ((portrait_tensor(portrait(), 32, 32)[0, :, 0].permute(1, 2, 0) + 1) * 127.5).round().byte().numpy()
    torch.testing.assert_close(motion(0, 3), encoded(np.concatenate([portrait_pixels[None]] * 2 + [shown[0][:3]])),
                               rtol=1e-4, atol=1e-4)
    assert torch.equal(motion(1), ended)  # chunk 1 on the unshifted grid: what chunk 0 left
    assert torch.equal(motion(0, 10_000), ended)  # nothing kept there: the last motion goes on


def test_lite_streams_24_new_frames_through_its_ltx_posterior_samples():
    """FlashHead Lite: 5 latents of the LTX VAE a chunk (x8 in time, x32 in space), the last 9 decoded
    frames colour-matched and re-encoded as a sample of the posterior drawn from the session's noise."""
    lite = get_family("flashhead-lite", config=LITE.with_(n_blocks=1, height=32, width=32, vae_width=0.25))
    dit = load_dit("random", "lite", seed=2, cfg=lite.config)
    vae = random_ltx_vae(3, width=lite.config.vae_width)
    stream = ChunkMotionStream(dit, vae, portrait_tensor(portrait(), 32, 32), seed=4)
    assert stream.reference.shape == (1, 128, 5, 1, 1) and stream.motion.shape == (1, 128, 1, 1, 1)
    tokens = np.random.default_rng(1).normal(size=(5, lite.config.audio_tokens, lite.config.dim)).astype(np.float32)
    frames = stream.decode(stream.denoise(tokens, 0))
    assert frames.shape == (24, 32, 32, 3) and lite.timeline.frames_per_chunk == 24
    assert stream.motion.shape == (1, 128, 2, 1, 1)  # the next chunk's 2 motion latents from 9 frames
    again = ChunkMotionStream(dit, vae, portrait_tensor(portrait(), 32, 32), seed=4)
    again.warm_thread()  # as a session's diffusion thread starts: its re-encode draws none of the session's noise
    again.decode(again.denoise(tokens, 0))
    assert torch.equal(again.motion, stream.motion)  # the posterior's samples follow the seed



def test_chunk_stages_drop_what_a_rollback_made_stale(parts):
    """After a rollback, diffusion drops conditioning of the old epoch unmade, and decode drops old-epoch
    latents undecoded and releases the stream: a turn's first speech chunk waits for no chunk that would
    never be shown, and starts from the motion latents of the chunk kept before it."""
    import asyncio

    from ingest_support import Recorder

    from charstream.stages.config import DecodeConfig, DiffusionConfig
    from charstream.stages.decode.chunks import ChunkDecodeStage
    from charstream.stages.diffusion.chunks import ChunkDiffusionStage
    from charstream.transport.messages import Conditioning, Control, ControlKind, Latents, VideoChunk

    dit, vae = parts
    stream = ChunkMotionStream(dit, vae, portrait_tensor(portrait(), 32, 32), seed=4)
    shape = (9, SMALL.audio_tokens, SMALL.dim)
    tokens = np.random.default_rng(1).normal(size=shape).astype(np.float32)
    audio = np.zeros(28 * 1_920, np.int16)
    diffusion = ChunkDiffusionStage(DiffusionConfig(threads=1), stream, shape)
    decode = ChunkDecodeStage(DecodeConfig(threads=1), stream)
    rec = Recorder()
    ctx = rec.context()

    def emitted(kind: type) -> list:
        return [m for _, m in rec.data if isinstance(m, kind)]

    def conditioning(chunk: int, epoch: int) -> Conditioning:
        return Conditioning("s1", chunk, tokens, audio, False, epoch)

    async def main() -> torch.Tensor:
        await diffusion.process(conditioning(0, 0), ctx)
        await decode.process(emitted(Latents)[-1], ctx)  # chunk 0 shown; the motion latents it left kept
        after_0 = stream.motion
        await diffusion.process(conditioning(1, 0), ctx)  # in flight when the rollback comes
        rollback = Control("s1", 1, ControlKind.ROLLBACK, chunk=0, epoch=1)
        await diffusion.control(rollback, ctx)
        await decode.control(rollback, ctx)
        await diffusion.process(conditioning(2, 0), ctx)  # queued before the rollback: dropped unmade
        await decode.process(emitted(Latents)[-1], ctx)  # chunk 1 of the old epoch: dropped undecoded
        assert stream._decoded.is_set()  # the next denoise need not wait for it
        await asyncio.wait_for(diffusion.process(conditioning(1, 1), ctx), 60)  # chunk 1 again
        await decode.process(emitted(Latents)[-1], ctx)
        await diffusion.process(conditioning(2, 1), ctx)
        made = emitted(Latents)[-1]
        await decode.process(Latents("s1", 2, made.latents[0], audio, False, 1), ctx)  # malformed: one latent
        assert stream._decoded.is_set()  # refused, and the stream may go on
        await diffusion.teardown()
        await decode.teardown()
        return after_0

    after_0 = asyncio.run(main())
    assert diffusion.stats.stale == 1 and diffusion.stats.rollbacks == 1 and decode.stale == 1 and decode.bad == 1
    assert diffusion.stats.generated == 4 and len(diffusion.stats.step_s) == 4
    assert [(m.chunk, m.epoch) for m in emitted(Latents)] == [(0, 0), (1, 0), (1, 1), (2, 1)]
    # each chunk in two parts: its lead's new frames, then the rest
    assert [(m.chunk, m.epoch, m.offset, len(m.frames)) for m in emitted(VideoChunk)] == \
        [(0, 0, 0, 8), (0, 0, 8, 20), (1, 1, 0, 8), (1, 1, 8, 20)] and stream.chunks == 2
    pinned = after_0.shape[2]  # the new chunk 1 continues chunk 0, not the dropped chunk 1
    assert torch.equal(torch.from_numpy(emitted(Latents)[2].latents[:, :pinned]), after_0[0].float())


def test_a_chunks_lead_frames_are_handed_over_before_its_rest_is_decoded(parts):
    """Pro decodes its first 4 latents, hands their 8 new frames over, then decodes the other 5 from the
    carried history; the frames handed over are the chunk's first. A lead that leaves no new frames, or
    the whole chunk, is refused."""
    dit, vae = parts
    stream = ChunkMotionStream(dit, vae, portrait_tensor(portrait(), 32, 32), seed=4)
    tokens = np.random.default_rng(2).normal(size=(9, SMALL.audio_tokens, SMALL.dim)).astype(np.float32)
    order = []
    runner = stream.runner
    decode_lead, decode_rest = runner._decode_lead, runner._decode_rest
    runner._decode_lead = lambda latents: order.append(("part", latents.shape[2])) or decode_lead(latents)
    runner._decode_rest = lambda latents, history: order.append(("part", latents.shape[2])) or decode_rest(latents, history)
    frames = stream.decode(stream.denoise(tokens), lead=lambda lead: order.append(("lead", lead.copy())))
    assert [step[0] for step in order] == ["part", "lead", "part"] and order[0][1] == 4 and order[2][1] == 5
    assert SMALL.lead_frames == 8 and np.array_equal(order[1][1], frames[:8]) and frames.shape[0] == 28
    for lead in (2, 9):
        with pytest.raises(ValueError, match="lead_latents"):
            SMALL.with_(lead_latents=lead)
    with pytest.raises(ValueError, match="needs the Wan VAE"):  # LTX decodes a chunk at once
        ChunkRunner(dit, random_ltx_vae(0, width=0.25))
