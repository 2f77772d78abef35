"""The web page in a real headless Chromium (Debian's, driven by Playwright): connect, play, mic, reports."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
import wave
from pathlib import Path

import numpy as np
import pytest

from charstream.pipeline.config import PipelineConfig
from charstream.pipeline.session import session_factory
from charstream.pipeline.web.server import EgressServer
from charstream.stages.agents.tts import synthesize
from charstream.stages.config import EgressConfig, IngestConfig
from charstream.transport.messages import TurnKind

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"

# Outside CI a developer without Chromium gets a skip; under CI (`make test` installs it) a missing
# browser is a failure, never a silent pass.
pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(shutil.which(CHROMIUM) is None and not os.environ.get("CI"),
                       reason="Debian chromium not installed (make browser)"),
]


def chromium_args(fake_mic_wav: Path) -> list[str]:
    return ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--autoplay-policy=no-user-gesture-required", "--use-fake-ui-for-media-stream",
            "--use-fake-device-for-media-stream", f"--use-file-for-fake-audio-capture={fake_mic_wav}"]


def write_speech_wav(path: Path) -> None:
    """espeak-ng speech with silence around it (Chromium loops the file as the microphone)."""
    speech = synthesize("Hello there, can you hear me? Tell me about the weather today.")
    silence = np.zeros(speech.sample_rate // 2, np.int16)
    samples = np.concatenate([silence, speech.samples, silence])
    with wave.open(str(path), "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(speech.sample_rate)
        f.writeframes(samples.tobytes())


def test_page_connects_plays_sends_mic_and_reports_frames():
    from playwright.async_api import async_playwright

    async def main(tmp: Path):
        wav = tmp / "speech.wav"
        write_speech_wav(wav)
        factory = session_factory(PipelineConfig(), testcard=True)
        server = EgressServer(EgressConfig(host="127.0.0.1", port=0), factory, access_key="browser-key")
        url = await server.start()
        out: dict = {}
        async with async_playwright() as p:
            context = await p.chromium.launch_persistent_context(
                str(tmp / "profile"), executable_path=CHROMIUM, headless=True, args=chromium_args(wav))
            page = await context.new_page()
            page.on("console", lambda m: out.setdefault("console", []).append(m.text))
            await page.goto(f"{url}/?code={server.issue_code()}&autoconnect=1")
            await page.wait_for_function("window.charstream.framesReported >= 48", timeout=40_000)
            out["url"] = page.url  # the one-time code left the address bar (and history)
            [peer] = server.sessions.values()
            [card] = [s.stages["card"] for s in factory.sessions.values()]
            # The fake mic's speech reaches silero-vad through the VAD-facing queue; its end of
            # speech starts a turn, whose latency segments come back to the page's overlay.
            await page.wait_for_function("window.charstream.turns.length >= 1", timeout=40_000)
            out["vad"] = list(card.vad_events)
            out["mic"] = (card.mic_frames, card.mic_peak_rms)
            out["video"] = await page.evaluate(
                "(() => { const v = document.getElementById('video');"
                " return {w: v.videoWidth, h: v.videoHeight, t: v.currentTime, paused: v.paused}; })()")
            out["page"] = await page.evaluate("window.charstream")
            out["reports"] = peer.timing.frames_reported
            out["unmatched"] = peer.timing.unmatched_reports
            out["deliveries"] = [d.seconds for d in peer.timing.chunk_deliveries]
            out["rtt"] = peer.timing.clock.rtt
            ARTIFACTS.mkdir(exist_ok=True)
            await page.screenshot(path=str(ARTIFACTS / "browser_page.png"))
            await page.click("#disconnect")
            for _ in range(50):
                if not server.sessions and not factory.sessions:
                    break
                await asyncio.sleep(0.1)
            out["left"] = (dict(server.sessions), dict(factory.sessions))
            await context.close()
        await server.stop()
        return out

    with tempfile.TemporaryDirectory() as tmp:
        out = asyncio.run(main(Path(tmp)))
    print({k: v for k, v in out.items() if k not in ("deliveries",)})
    assert out["video"]["w"] == 128 and out["video"]["h"] == 128 and out["video"]["t"] > 0 and not out["video"]["paused"]
    assert out["page"]["micSent"] and out["page"]["pings"] >= 3 and out["page"]["error"] is None
    assert "code=" not in out["url"] and "autoconnect=1" in out["url"]
    assert out["mic"][0] >= 100 and out["mic"][1] > 500  # speech energy arrived, not silence
    kinds = [e.kind for e in out["vad"]]
    assert kinds[:2] == [TurnKind.USER_SPEECH_START, TurnKind.USER_SPEECH_END]  # silero heard the user
    [turn] = out["page"]["turns"][:1]
    assert set(turn["segments_ms"]) == {"agent", "pipeline", "delivery", "total"}
    assert 0 < turn["segments_ms"]["delivery"] < 3000  # plausible; its size is the benchmark's business
    assert out["reports"] >= 48 and out["unmatched"] <= 5  # first-frame reports arrive and map to frames
    assert len(out["deliveries"]) >= 8 and 0 < float(np.median(out["deliveries"])) < 3.0
    assert (ARTIFACTS / "browser_page.png").stat().st_size > 1000
    assert out["left"] == ({}, {})  # disconnect released the session


def _heard_offline(wav: Path) -> str:
    """What the built-in agent's recogniser hears in ``wav`` through Opus, fed as the agent hears it."""
    from charstream.pipeline.bench.asr import opus_round_trip, recognise
    from charstream.stages.agents.asr import TurnRecognizer
    from charstream.stages.ingest.resample import resample, to_int16
    from charstream.stages.ingest.vad import UserAudioVAD

    with wave.open(str(wav)) as f:
        rate, samples = f.getframerate(), np.frombuffer(f.readframes(f.getnframes()), np.int16)
    mic = opus_round_trip(to_int16(resample(samples.astype(np.float32) / 32768.0, rate, 48_000)))

    async def hear() -> str:
        ears = await TurnRecognizer.load(IngestConfig().recognizer)
        return (await recognise(ears, UserAudioVAD(sample_rate=48_000), mic, False))[0]

    return asyncio.run(hear())


def test_serve_default_hears_the_fake_microphone_and_answers():
    """``serve``'s default session (the full pipeline, the built-in agent) in real Chromium: the fake
    microphone's sentence, one the agent was never built around, is heard with its content words, as
    many as the same recogniser hears in the same file offline through Opus (the trace says what was
    recognised), answered on screen, and
    the trace's user-experienced latency agrees with the page's own measurement of it (the page
    meters its microphone on its own clock; the server dates the end of speech at capture through
    RTP timestamps + RTCP sender reports + the data channel's clock offset). Two consecutive
    sessions here; ``charstream bench mic-sessions`` runs 20 (docs/PERF.md)."""
    from charstream.pipeline.bench.mic_sessions import SENTENCE, run_sessions, summarize
    from charstream.pipeline.bench.wer import normalise
    from charstream.stages.agents.domain_lm import corpus_lines, words
    from charstream.stages.shared.tracing import read_jsonl

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        results = asyncio.run(run_sessions(2, Path(tmp), out=out))
        offline = set(normalise(_heard_offline(Path(tmp) / "speech.wav")))
        for _ in range(100):  # serve --out writes each report once its session has ended
            reports = sorted(out.glob("*/report.md"))
            if len(reports) == 2 and all((r.parent / "waterfall.png").is_file() for r in reports):
                break
            time.sleep(0.1)
        traces = [read_jsonl(r.parent / "trace.jsonl") for r in reports]
    summary = summarize(results)
    print(summary, [(r.heard, r.trace_total_ms, r.page_total_ms, r.stamps) for r in results])
    assert summary["deaf"] == 0 and summary["answered"] == 2, [r.error for r in results]
    assert len(traces) == 2 and all(t[0]["heard"] and t[0]["answer"] and "vad" in t[0] for t in traces), traces
    assert " ".join(words(SENTENCE)) not in {" ".join(line) for line in corpus_lines()}
    content = {"cousin", "denver", "tomorrow", "mountains"}
    # Moonshine hears "tomorrow" in espeak's en-us voice as other words, offline too
    assert len(content & offline) >= 2, offline
    for r in results:
        assert r.mic_dropped == 0 and r.heard and r.answer  # every word reached the recogniser
        heard = content & set(normalise(r.heard))
        assert len(heard) >= max(2, len(content & offline) - 1), (r.heard, offline)  # WebRTC's audio path may cost one
        assert r.stamps["user_speech_end"] < r.stamps["vad_speech_end"] < r.stamps["vad_decided"]
        # the trace's and the page's clocks agree within a few ms in most sessions; now and then one
        # differs by 40-75 ms (docs/PERF.md, Turn latency; cause not established): a bound, not a median
        assert abs(r.trace_total_ms - r.page_total_ms) <= 100, (r.trace_total_ms, r.page_total_ms)
        # A stall bound, not the wait's size (1.1-1.7 s on this 2-core VM, 0.74 s median on a quieter
        # day: docs/PERF.md, which the benchmark is for): an answer 4 s late has hung somewhere.
        assert r.page_total_ms < 4000
