"""A FlashHead session through every stage on the CPU: the scripted agent (real speech synthesis, silero VAD)
-> ingest -> conditioning (wav2vec2 + adapter over the 8 s rolling context) -> chunk diffusion (a 2-block DiT
at the real width) -> chunk decode (the Wan VAE at a quarter of its channels, the chunk's last frames colour-matched and re-encoded) ->
playout at 25 fps. Seeded random weights through the loaders; a 32 x 32 picture. Asserts behaviour, not
speed: frames on the 25 fps timeline, 28 new frames and 28 x 1,920 samples a chunk, motion latents fed from
the previous chunk, the turn's speech reaching a chunk."""

from __future__ import annotations

import asyncio
from collections import defaultdict

import numpy as np
import torch

from charstream.model.families.flashhead.config import TEST
from charstream.model.families.flashhead.family import FlashHeadFamily
from charstream.pipeline.config import PipelineConfig
from charstream.pipeline.session import LiveSession

SMALL = TEST.with_(height=32, width=32, vae_width=0.25)
TIMEOUT_S = 150


def portrait() -> np.ndarray:
    y, x = np.mgrid[0:48, 0:40]
    face = ((x - 20) ** 2 + (y - 22) ** 2 < 200)[..., None]
    return np.where(face, [210, 160, 130], [40, 60, 90]).astype(np.uint8)


def test_flashhead_session_through_every_stage():
    config = PipelineConfig(preset="flashhead-pro")
    config.ingest.adapter = "scripted"
    config.ingest.scripted_recognizer = False
    config.ingest.script = [{"user": "Hello.", "agent": "Hi there, nice to see you."}]
    config.ingest.lead_in_s = 0.2
    config.playout.target_depth_chunks = 1
    config.diffusion.threads = config.decode.threads = 2

    async def main():
        session = LiveSession(config, "fh-smoke", weights="random", peer=False,
                              family=FlashHeadFamily("pro", config=SMALL), portrait=portrait())
        stream = next(n for n in session.runner.graph.nodes if n.name == "decode").kwargs["stream"].get()
        # each chunk made, by its first media frame, and the motion latents it started from
        used: list[tuple[int, torch.Tensor]] = []
        ready, denoise = stream.ready, stream.runner.denoise
        starts: list[int] = []

        def readying(chunk=None, timeout=None, start=None):
            ready(chunk, timeout, start)
            starts.append(stream.start)

        def recording(streams, tokens):
            latents = denoise(streams, tokens)
            used.append((starts[-1], latents[0][:, :, :SMALL.motion_latents].clone()))
            return latents

        stream.ready, stream.runner.denoise = readying, recording
        session.start()
        frames, index = [], 0
        try:
            await asyncio.wait_for(session.output.wait_started(), TIMEOUT_S)
            async with asyncio.timeout(TIMEOUT_S):
                while not any(f.speaking for f in frames) or len({f.chunk for f in frames if f.chunk is not None}) < 3:
                    frame = await session.output.frame_at(index)
                    frames.append(frame)
                    index = frame.index + 1
        finally:
            result = await session.stop("test done")
        return session, stream, used, frames, result

    session, stream, used, frames, result = asyncio.run(main())
    assert result is not None and result.ok, result
    assert session.output.timeline.fps == 25 and session.output.timeline.frames_per_chunk == 28
    assert [f.index for f in frames] == list(range(len(frames)))  # every tick of the 25 fps clock
    assert all(f.audio.shape == (1_920,) for f in frames)  # 48 kHz / 25 a frame, hold frames too
    by_chunk = defaultdict(list)
    for f in frames:
        if f.chunk is not None:
            by_chunk[(f.epoch, f.chunk)].append(f.frame_in_chunk)
    whole = [positions for positions in by_chunk.values() if positions[0] == 0 and len(positions) == 28]
    assert whole and all(p == list(range(28)) for p in whole)  # 28 new frames a chunk, in order
    assert all(f.image.shape == (32, 32, 3) for f in frames if f.chunk is not None)
    # chunk 0 (made again after a rollback to the start, too) continues the portrait from its first latent;
    # later ones start from the frames before them re-encoded: not zeros, not the portrait's latents
    assert len(used) >= 3 and used[0][0] == 0
    for start, motion in used:
        if start == 0:
            assert torch.equal(motion[:, :, :1], stream.reference[:, :, :1])
        else:
            assert motion.abs().mean() > 1e-3 and not torch.allclose(motion[:, :, :1], stream.reference[:, :, :1], atol=1e-3)
    assert any(start > 0 for start, _ in used)
    # the turn's speech reached a chunk: its frames carry the turn and play its audio
    speaking = [f for f in frames if f.speaking]
    assert speaking and speaking[0].trace is not None and speaking[0].trace.turn_id is not None
    assert max(np.abs(f.audio).max() for f in speaking) > 1_000
