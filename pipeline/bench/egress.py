"""Egress benchmarks: delivery (playout → presented in Chromium), software encode cost and the video
track's event-loop time.

    charstream bench egress delivery [--seconds 20] [--size 128] [--codec VP8]
    charstream bench egress encode [--frames 48] [--height 1088] [--width 704]
    charstream bench egress track [--frames 96] [--size 512]

*delivery*: a test-card session served to headless Chromium (Debian ``chromium``, Playwright) on
loopback; for every chunk's first frame, the page reports when it was presented
(``requestVideoFrameCallback``), mapped to the server clock by the ping/pong offset, minus the
time playout released it. The in-process aiortc client is measured the same way for comparison
(its figure includes aiortc's receive jitter buffer, which holds each frame until the next one
starts). *encode*: aiortc's own VP8 (libvpx) and H.264 (libx264) encoders, per frame, on moving
test-card frames, including the RGB → YUV conversion aiortc does. *track*: what each released frame costs
the event loop in the WebRTC video track's ``recv`` (the loop that also runs the session's stages and
aiortc's send loops), for frames released with their yuv420p planes (as playout makes them, on a worker
thread, for a WebRTC reader) and without (the track converts them itself), and the worker's conversion.

Each prints a table and writes JSON (``--json``).
"""

from __future__ import annotations

import argparse
import asyncio
import fractions
import itertools
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import av
import numpy as np

from charstream.pipeline.bench.output import commit_id, percentiles
from charstream.pipeline.config import PipelineConfig
from charstream.pipeline.runtime.runner import Node
from charstream.pipeline.session import session_factory
from charstream.pipeline.web.client import EgressClient
from charstream.pipeline.web.server import EgressServer
from charstream.stages.config import EgressConfig
from charstream.stages.egress.testcard import CardSource, frame_image

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--autoplay-policy=no-user-gesture-required", "--use-fake-ui-for-media-stream",
                 "--use-fake-device-for-media-stream"]


def _percentiles(values_ms: list[float]) -> dict[str, float]:
    p = percentiles(values_ms, (10, 50, 90))
    return {"n": len(values_ms), "median_ms": round(p["p50"], 2), "p10_ms": round(p["p10"], 2), "p90_ms": round(p["p90"], 2)}


async def _chromium_delivery(url: str, server: EgressServer, seconds: float, warmup: float) -> dict:
    from playwright.async_api import async_playwright

    with tempfile.TemporaryDirectory() as profile:
        async with async_playwright() as p:
            context = await p.chromium.launch_persistent_context(profile, executable_path=CHROMIUM, headless=True,
                                                                 args=CHROMIUM_ARGS)
            page = await context.new_page()
            await page.goto(f"{url}/?code={server.issue_code()}&autoconnect=1")
            await page.wait_for_function("window.charstream.framesReported >= 1", timeout=30_000)
            [peer] = server.sessions.values()
            await asyncio.sleep(warmup)
            peer.timing.chunk_deliveries.clear()
            await asyncio.sleep(seconds)
            deliveries = [d.seconds * 1e3 for d in peer.timing.chunk_deliveries]
            rtt = peer.timing.clock.rtt
            receiver = await page.evaluate("window.charstreamStats()")
            version = context.browser.version if context.browser else ""
            await context.close()
    return {**_percentiles(deliveries), "clock_rtt_ms": round(rtt * 1e3, 2), "browser": version,
            "receiver": receiver}


async def _aiortc_delivery(url: str, server: EgressServer, seconds: float, warmup: float) -> dict:
    session_id, token = server.create_session()
    client = EgressClient()
    await client.connect(url, token)
    await client.wait_for_video(1, timeout=30)
    peer = server.sessions[session_id]
    await asyncio.sleep(warmup)
    peer.timing.chunk_deliveries.clear()
    await asyncio.sleep(seconds)
    deliveries = [d.seconds * 1e3 for d in peer.timing.chunk_deliveries]
    await client.close()
    return _percentiles(deliveries)


async def delivery(seconds: float, size: int, codec: str, vad: bool, warmup: float = 3.0) -> dict:
    card = Node("card", CardSource, {"height": size, "width": size, "listen": vad})
    server = EgressServer(EgressConfig(port=0, codec=codec), session_factory(PipelineConfig(), testcard=card))
    url = await server.start()
    try:
        results = {"chromium": await _chromium_delivery(url, server, seconds, warmup),
                   "aiortc_client": await _aiortc_delivery(url, server, seconds, warmup)}
    finally:
        await server.stop()
    return {"benchmark": "egress_delivery", "size": size, "codec": codec, "seconds": seconds, "vad": vad, **results}


def encode(frames: int, height: int, width: int) -> dict:
    from aiortc.codecs import get_encoder
    from aiortc.rtcrtpparameters import RTCRtpCodecParameters

    codecs = {
        "VP8": RTCRtpCodecParameters(mimeType="video/VP8", clockRate=90000, payloadType=96),
        "H264": RTCRtpCodecParameters(mimeType="video/H264", clockRate=90000, payloadType=97,
                                      parameters={"packetization-mode": "1", "profile-level-id": "42e01f"}),
    }
    contents = {"card": [frame_image(i, height, width) for i in range(frames)],
                "texture": _moving_texture(frames, height, width)}
    results = {}
    for (content, images), (name, params) in itertools.product(contents.items(), codecs.items()):
        encoder = get_encoder(params)
        times, sizes = [], []
        for i, image in enumerate(images):
            frame = av.VideoFrame.from_ndarray(image, format="rgb24")
            frame.pts, frame.time_base = i * 3750, fractions.Fraction(1, 90000)
            start = time.perf_counter()
            payloads, _ = encoder.encode(frame, force_keyframe=(i == 0))
            times.append((time.perf_counter() - start) * 1e3)
            sizes.append(sum(len(p) for p in payloads))
        steady = times[4:]  # the first frames include encoder set-up and the keyframe
        results[f"{name}/{content}"] = {**_percentiles(steady), "first_frame_ms": round(times[0], 2),
                         "mean_bytes": int(np.mean(sizes[4:])), "realtime_share_of_frame": round(
                             statistics.median(steady) / (1000 / 24), 3)}
    return {"benchmark": "egress_encode", "height": height, "width": width, "frames": frames, **results}


async def track(frames: int, size: int) -> dict:
    from charstream.stages.egress.tracks import PlayoutVideoTrack, TrackStart
    from charstream.stages.playout.output import PlayoutOutput, ReleasedFrame
    from charstream.stages.playout.yuv import Yuv420Converter
    from charstream.timeline import CHARACTERS

    images = np.stack(_moving_texture(frames, size, size))
    converter = Yuv420Converter()
    converter.convert(images[:4])
    start = time.perf_counter()
    planes = converter.convert(images)
    results = {"conversion_per_frame_ms": round((time.perf_counter() - start) * 1e3 / frames, 3)}
    silence = np.zeros(CHARACTERS.samples_per_frame, np.int16)
    for mode in ("converted", "rgb"):
        output = PlayoutOutput(history_frames=frames, timeline=CHARACTERS)
        begins = TrackStart(output)
        begins.index = 0  # the frames are all released already: read them from the first
        video = PlayoutVideoTrack(begins)
        for i in range(frames):
            output.publish(ReleasedFrame(i, images[i], silence, 0, i, False, 0, None, False, time.time(),
                                         planes[i] if mode == "converted" else None))
        output.start(time.monotonic())
        times = []
        for _ in range(frames):
            begin = time.perf_counter()
            await video.recv()
            times.append((time.perf_counter() - begin) * 1e3)
        results[mode] = _percentiles(times[4:])
    return {"benchmark": "egress_track", "size": size, "frames": frames, **results}


def _moving_texture(frames: int, height: int, width: int) -> list[np.ndarray]:
    """Camera-like content: smooth random texture with fine grain, panning 3 px per frame."""
    rng = np.random.default_rng(0)
    coarse = rng.integers(0, 256, (height // 16 + 2, (width + 3 * frames) // 16 + 2, 3)).astype(np.float32)
    smooth = np.kron(coarse, np.ones((16, 16, 1), np.float32))[:height, : width + 3 * frames]
    textured = np.clip(smooth + rng.normal(0, 12, smooth.shape), 0, 255).astype(np.uint8)
    return [np.ascontiguousarray(textured[:, 3 * i: 3 * i + width]) for i in range(frames)]


def _machine() -> dict:
    return {"date": time.strftime("%Y-%m-%d"), "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "av": av.__version__, "commit": commit_id()}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="which", required=True)
    d = sub.add_parser("delivery")
    d.add_argument("--seconds", type=float, default=20)
    d.add_argument("--size", type=int, default=128)
    d.add_argument("--codec", default="VP8", choices=["VP8", "H264"])
    d.add_argument("--no-vad", action="store_true", help="do not run silero-vad on the (fake) microphone")
    d.add_argument("--json", default="test-artifacts/bench_egress_delivery.json")
    e = sub.add_parser("encode")
    e.add_argument("--frames", type=int, default=48)
    e.add_argument("--height", type=int, default=1088)
    e.add_argument("--width", type=int, default=704)
    e.add_argument("--json", default="test-artifacts/bench_egress_encode.json")
    t = sub.add_parser("track")
    t.add_argument("--frames", type=int, default=96)
    t.add_argument("--size", type=int, default=512)
    t.add_argument("--json", default="test-artifacts/bench_egress_track.json")


def run(args: argparse.Namespace) -> int:

    if args.which == "delivery":
        result = asyncio.run(delivery(args.seconds, args.size, args.codec, vad=not args.no_vad))
        print(f"delivery playout -> presented, {args.size}x{args.size} {args.codec}, loopback, {args.seconds:.0f} s")
        print(f"{'client':<16}{'chunks':>8}{'median ms':>11}{'p10 ms':>9}{'p90 ms':>9}")
        for client in ("chromium", "aiortc_client"):
            r = result[client]
            print(f"{client:<16}{r['n']:>8}{r['median_ms']:>11}{r['p10_ms']:>9}{r['p90_ms']:>9}")
        for kind, stats in result["chromium"]["receiver"].items():
            print(f"chromium {kind}: " + ", ".join(f"{k} {v:.1f}" for k, v in stats.items() if isinstance(v, float)))
    elif args.which == "track":
        result = asyncio.run(track(args.frames, args.size))
        print(f"the video track's event-loop time per released frame, {args.size}x{args.size}, this CPU")
        print(f"{'frames released':<34}{'median ms':>11}{'p90 ms':>9}")
        for mode, label in (("converted", "with their yuv420p planes"), ("rgb", "RGB only (the track converts)")):
            print(f"{label:<34}{result[mode]['median_ms']:>11}{result[mode]['p90_ms']:>9}")
        print(f"playout's conversion on its worker thread: {result['conversion_per_frame_ms']} ms a frame")
    else:
        result = encode(args.frames, args.height, args.width)
        print(f"software encode per frame at {args.width}x{args.height} (aiortc encoders, this CPU)")
        print(f"{'codec/content':<15}{'median ms':>11}{'p90 ms':>9}{'of 41.7 ms':>12}{'bytes':>9}")
        for codec in ("VP8/card", "H264/card", "VP8/texture", "H264/texture"):
            r = result[codec]
            print(f"{codec:<15}{r['median_ms']:>11}{r['p90_ms']:>9}{r['realtime_share_of_frame']:>12}{r['mean_bytes']:>9}")
    result["machine"] = _machine()
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")
    return 0

