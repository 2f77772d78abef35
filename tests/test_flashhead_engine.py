"""FlashHead Lite sessions hosted by a real ``charstream engine`` process (a 2-block DiT at the real width,
a quarter-width VAE, 32 x 32, seeded random weights, CPU): each front-end sends its portrait in its host request, the engine
makes the session's chunk stream and runs both sessions' chunks and audio encodes through its batchers,
and a session releases the frames it releases with its model stages in its own process. Then the
engine's refusal of a host request without a portrait or with a malformed one, and of a start without
its weights."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
from engine_support import frames_released, start_engine, stop_engine

from charstream.pipeline.arguments import sized_family
from charstream.pipeline.config import PipelineConfig
from charstream.pipeline.runtime.engine_link import EngineError, engine_call
from charstream.pipeline.session import LiveSession

FRAMES = 24  # a whole chunk (Lite: 24 new frames)
TIMEOUT_S = 150


def face(shift: int) -> np.ndarray:
    y, x = np.mgrid[0:48, 0:40]
    inside = ((x - 20 - shift) ** 2 + (y - 22) ** 2 < 200)[..., None]
    return np.where(inside, [210, 160, 130 + 10 * shift], [40, 60, 90]).astype(np.uint8)


def session(shift: int, endpoint: str | None) -> LiveSession:
    """A listening session (no microphone, so every chunk is a listening chunk) animating ``face(shift)``; its
    model stages in the engine at ``endpoint``, or in this process (None). Seed 0, the engine's: random
    weights are seeded by it, and so is each session's noise."""
    config = PipelineConfig(preset="flashhead-lite", hosting="engine" if endpoint else "inproc")
    if endpoint:
        config.engine_endpoint = endpoint
    config.playout.target_depth_chunks = 1
    config.diffusion.threads = config.decode.threads = 1
    return LiveSession(config, f"s{shift}", weights="random", peer=False, family=sized_family("flashhead-lite", 2, 32, 0.25),
                       portrait=face(shift))


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    folder = tmp_path_factory.mktemp("engine")
    endpoint = f"ipc://{folder}/engine.sock"
    proc = start_engine(endpoint, folder / "engine.log", "--preset", "flashhead-lite", "--weights", "random",
                        "--blocks", "2", "--size", "32", "--vae-width", "0.25", "--batch-sessions", "2")
    try:
        yield endpoint
    finally:
        code = stop_engine(proc)
    assert code == 0, (folder / "engine.log").read_text()[-3000:]


def test_flashhead_sessions_in_an_engine_release_the_frames_they_make_in_their_own_process(engine):
    async def main():
        hosted = [session(shift, engine) for shift in (0, 3)]
        for s in hosted:
            s.start()
        frames = await asyncio.wait_for(asyncio.gather(*(frames_released(s, FRAMES) for s in hosted)), TIMEOUT_S)
        status = await engine_call(engine, {"cmd": "status"})
        results = [await s.stop() for s in hosted]
        s = session(0, None)  # the first of them with its model stages in this process
        s.start()
        alone = await asyncio.wait_for(frames_released(s, FRAMES), TIMEOUT_S)
        await s.stop()
        return hosted, frames, status, results, alone

    hosted, frames, status, results, alone = asyncio.run(main())
    assert all(r is not None and r.ok for r in results), [r and r.error for r in results]
    for s, result in zip(hosted, results, strict=True):
        assert "diffusion" not in s.stages and "playout" in s.stages  # the model stages ran in the engine
        assert result.edges["decode->playout"]["receiver"]["received"] >= 1
    # both sessions' chunks went through the engine's batchers
    assert status["batchers"]["diffusion"]["served"] >= 2 and status["batchers"]["decode"]["served"] >= 2, status
    assert status["batchers"]["encode"]["served"] >= 2, status
    for got in frames:
        assert len(got) == FRAMES and {k[1] for k in got} == set(range(24))  # 24 new frames a chunk
        assert all(image.shape == (32, 32, 3) for image in got.values())
    # a batch of two in the engine against the session alone in its own process: the same chunks within a
    # level or two
    assert sorted(frames[0]) == sorted(alone)
    worst = max(np.abs(frames[0][k].astype(int) - alone[k].astype(int)).max() for k in alone)
    assert worst <= 2, worst
    # each session animates its own portrait
    assert max(np.abs(frames[0][k].astype(int) - frames[1][k].astype(int)).max() for k in frames[0]) > 20


def test_a_flashhead_engine_refuses_a_host_request_without_a_good_portrait(engine):
    config = dataclasses.asdict(PipelineConfig(preset="flashhead-lite", hosting="engine"))
    base = {"cmd": "host", "session_id": "bad", "config": config, "weights": None, "nodes": ["conditioning"],
            "inputs": [], "outputs": [], "control": "ipc:///tmp/none", "keys": None}

    async def refusal(portrait) -> str:
        with pytest.raises(EngineError) as info:
            await engine_call(engine, {**base, "portrait": portrait})
        return str(info.value)

    async def main():
        return [await refusal(p) for p in (None, {"shape": [48, 40, 3], "rgb": b"\0" * 10},
                                           {"shape": [4096, 4096, 3], "rgb": b""}, "face.png")]

    none, short, large, name = asyncio.run(main())
    assert "animates a portrait: the request carries none" in none
    assert "rgb must be 5760 bytes" in short
    assert "of 1..2048 pixels a side" in large
    assert "expected a map of shape and rgb" in name
    status = asyncio.run(engine_call(engine, {"cmd": "status"}))
    assert status["hosted"] == 0


def test_a_flashhead_engine_needs_its_weights_folder_or_random(tmp_path):
    from charstream.pipeline.cli import main

    with pytest.raises(SystemExit, match="needs --weights DIR"):
        main(["engine", "--preset", "flashhead-lite"])
    with pytest.raises(SystemExit, match=str(tmp_path / "none")):
        main(["engine", "--preset", "flashhead-lite", "--weights", str(tmp_path / "none")])
