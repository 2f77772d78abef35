"""Consecutive microphone sessions in real headless Chromium against ``serve``'s default: the full
pipeline per session with the built-in agent, the browser's fake microphone playing espeak speech
whose end is known.

    charstream bench mic-sessions [--sessions 20] [--concurrent 1] [--json mic-sessions.json]

Each session: a fresh browser context opens the page with ``autoconnect``; Chromium's fake capture
device plays a WAV (``LEAD_S`` of silence, one sentence, then silence) as the microphone; the
session is done when the page has the first answered turn (or after ``--timeout``).
``--concurrent K`` runs them K at a time (each with its own pipeline and agent). Per session it
records whether the user was heard (a traced turn with what the recogniser heard) and answered
(the page saw the turn's first speaking frame), the trace's ``total`` (user's end of speech → first
speaking frame presented, both on the page's clock through the server's mapping), the page's own
measurement of the same (its microphone meter's end of speech → that frame), and their difference.
Needs Debian's chromium (``make browser``) and Playwright (the ``dev`` extra).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
import wave
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

CHROMIUM = "/usr/bin/chromium"
LEAD_S = 5.0  # silence before the sentence: the session is up and the clocks are mapped by then
TAIL_S = 20.0  # silence after it: Chromium loops the file, and a second sentence would barge in
# Outside the agent's corpus and reply rules (and the recogniser benchmark's evaluation set): what is
# heard is the recogniser's own, not a phrase it was built around
SENTENCE = "My cousin is flying to Denver tomorrow to see the mountains."


@dataclass
class MicSessionResult:
    index: int
    heard: str | None = None  # what the recogniser heard (an answered turn's trace record; None: not heard)
    answer: str | None = None
    answered: bool = False  # the page saw the answer's first speaking frame
    trace_total_ms: float | None = None
    page_total_ms: float | None = None
    segments_ms: dict[str, float] = field(default_factory=dict)
    mic_frames: int = 0
    mic_dropped: int = 0  # mic frames the session's queue dropped (ingest behind)
    stamps: dict[str, float] = field(default_factory=dict)  # the answered turn's trace stamps
    page_speech_ends_ms: list[float] = field(default_factory=list)  # the page meter's, on the page clock
    seconds: float = 0.0
    error: str | None = None

    @property
    def deaf(self) -> bool:
        return self.heard is None


def chromium_args(fake_mic_wav: Path) -> list[str]:
    return ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--autoplay-policy=no-user-gesture-required", "--use-fake-ui-for-media-stream",
            "--use-fake-device-for-media-stream", f"--use-file-for-fake-audio-capture={fake_mic_wav}"]


def write_speech_wav(path: Path, text: str = SENTENCE, lead_s: float = LEAD_S, tail_s: float = TAIL_S) -> float:
    """espeak-ng speech between silences; returns where its last sample above -40 dBFS is (s). Synthesised
    in a fresh interpreter: espeak-ng's output drifts with each call in a process, so the microphone says
    the same samples whatever this process synthesised before."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from charstream.stages.agents.tts import synthesize

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        speech = pool.submit(synthesize, text).result()
    rate = speech.sample_rate
    samples = np.concatenate([np.zeros(int(lead_s * rate), np.int16), speech.samples,
                              np.zeros(int(tail_s * rate), np.int16)])
    with wave.open(str(path), "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(rate)
        f.writeframes(samples.tobytes())
    return float(np.flatnonzero(np.abs(samples.astype(np.int32)) > 328)[-1] / rate)


async def run_sessions(count: int, workdir: Path, timeout_s: float = 45.0, preset: str = "tiny",
                       out: Path | None = None, concurrent: int = 1) -> list[MicSessionResult]:
    """``count`` sessions, ``concurrent`` at a time, against ``serve``'s own session factory
    (``out``: its ``--out DIR``)."""
    from playwright.async_api import async_playwright

    from charstream.pipeline.config import PipelineConfig
    from charstream.pipeline.serve import make_factory
    from charstream.pipeline.web.server import EgressServer

    wav = workdir / "speech.wav"
    write_speech_wav(wav)
    config = PipelineConfig(preset=preset)
    config.egress.port = 0
    factory = make_factory("pipeline", config, out)
    server = EgressServer(config.egress, factory, access_key="bench-key")
    url = await server.start()
    results = []
    try:
        async with async_playwright() as p:
            browser = await p.chromium.launch(executable_path=CHROMIUM, headless=True, args=chromium_args(wav))
            try:
                for first in range(0, count, concurrent):
                    batch = range(first, min(first + concurrent, count))
                    results += await asyncio.gather(*(one_session(browser, url, server, factory.sessions, index,
                                                                  timeout_s) for index in batch))
            finally:
                await browser.close()
    finally:
        await server.stop()
    return results


async def one_session(browser, url: str, server, live: dict, index: int, timeout_s: float) -> MicSessionResult:
    result = MicSessionResult(index)
    started = time.monotonic()
    context = await browser.new_context()
    try:
        page = await context.new_page()
        await page.goto(f"{url}/?code={server.issue_code()}&autoconnect=1")
        try:
            await page.wait_for_function("window.charstream.turns.length >= 1", timeout=timeout_s * 1000)
        except Exception as e:  # playwright's TimeoutError: the session was deaf or never answered
            result.error = f"no answered turn in {timeout_s:.0f} s: {type(e).__name__}"
        state = await page.evaluate("window.charstream")
        session = live.get(state.get("sessionId"))
        if session is not None:
            result.mic_frames, result.mic_dropped = session.user_audio.received, session.user_audio.dropped
            # the page's turn message left after the tracer merged the turn's client stamp
            record = next((r for r in session.tracer.records if r.heard is not None), None)
            if record is not None:
                result.heard, result.answer, result.stamps = record.heard, record.answer, dict(record.stamps)
        result.page_speech_ends_ms = state["micSpeechEnds"]
        if state["turns"]:
            turn = state["turns"][0]
            result.answered = True
            result.segments_ms = turn["segments_ms"]
            result.trace_total_ms = turn["segments_ms"].get("total")
            result.page_total_ms = turn.get("pageTotalMs")
        await page.click("#disconnect")
        for _ in range(50):
            if state.get("sessionId") not in server.sessions:
                break
            await asyncio.sleep(0.1)
    finally:
        await context.close()
        result.seconds = time.monotonic() - started
    return result


def summarize(results: list[MicSessionResult]) -> dict:
    totals = [r.trace_total_ms for r in results if r.trace_total_ms is not None]
    page = [r.page_total_ms for r in results if r.page_total_ms is not None]
    diffs = [r.trace_total_ms - r.page_total_ms for r in results
             if r.trace_total_ms is not None and r.page_total_ms is not None]
    agent = [r.segments_ms["agent"] for r in results if "agent" in r.segments_ms]
    return {
        "sessions": len(results), "heard": sum(not r.deaf for r in results),
        "answered": sum(r.answered for r in results), "deaf": sum(r.deaf for r in results),
        "trace_total_ms_median": statistics.median(totals) if totals else None,
        "page_total_ms_median": statistics.median(page) if page else None,
        "agent_ms_median": statistics.median(agent) if agent else None,
        "trace_minus_page_ms_max_abs": max(map(abs, diffs)) if diffs else None,
        "trace_minus_page_ms_median": statistics.median(diffs) if diffs else None,
        "cpus": os.cpu_count(), "load_1min_after": os.getloadavg()[0],
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sessions", type=int, default=20)
    parser.add_argument("--concurrent", type=int, default=1, help="sessions at a time")
    parser.add_argument("--timeout", type=float, default=45.0, help="seconds per session to the first answer")
    parser.add_argument("--json", default=None, help="write per-session results and the summary here")


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        results = asyncio.run(run_sessions(args.sessions, Path(tmp), args.timeout, concurrent=args.concurrent))
    print(f"{'#':>3} {'heard':<34} {'answered':>8} {'trace total':>12} {'page total':>11} {'diff':>6}")
    for r in results:
        diff = (f"{r.trace_total_ms - r.page_total_ms:+.0f}" if r.trace_total_ms is not None
                and r.page_total_ms is not None else "-")
        print(f"{r.index:>3} {(r.heard or '(deaf)')[:34]:<34} {str(r.answered):>8} "
              f"{r.trace_total_ms or float('nan'):>9.0f} ms {r.page_total_ms or float('nan'):>8.0f} ms {diff:>6}")
    summary = summarize(results)
    print(json.dumps(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "sessions": [asdict(r) for r in results]}, f, indent=2)
    return 0 if summary["deaf"] == 0 and summary["answered"] == len(results) else 1

