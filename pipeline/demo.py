"""``charstream demo``: a scripted conversation through every stage, on CPU, to a real WebRTC client.

The built-in scripted agent (espeak-ng voices, silero-vad on the simulated user's microphone)
drives a session of the full graph (``pipeline.session``): conditioning → diffusion → decode →
playout, egress over aiortc. Without ``--serve`` an in-process aiortc client connects over
loopback, reports presented frames on the data channel (the trace's last stamp) and records what
it received; with ``--serve`` a browser connects to the printed address instead.

Writes into ``--out`` (default ``./demo-out``): ``trace.jsonl`` (one line per turn, the seven
contract stamps), ``report.md`` + ``waterfall.png`` (``charstream trace report``), ``playout.json``
(playout's figures: underruns by cause, rollbacks, fps), and ``session.mp4`` (what the client
received: 24 fps video + audio; not with ``--serve``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from charstream.logs import configure_logging
from charstream.pipeline import arguments
from charstream.pipeline.config import PipelineConfig
from charstream.stages.config import AGENT_PACES
from charstream.stages.shared.metrics import REGISTRY, serve_metrics
from charstream.stages.shared.tracing import SEGMENTS, TurnRecord, intervals

QUIET_S = 0.5  # listening after the last reply before the demo ends
CLIENT_GRACE_S = 5.0  # how long to wait for the client's last frame reports after that
CLIENT_CATCH_UP_S = 15.0  # how long the client may take to receive the media up to the end


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--turns", type=int, default=None,
                        help="conversation turns (default: the whole script; the built-in one has 4, "
                             "repeated when more are asked)")
    parser.add_argument("--preset", default="tiny", help="model preset (default: tiny)")
    parser.add_argument("--model", default=None,
                        help="model to run: a preset or a family (flashhead-pro: with --weights DIR|random and "
                             "--portrait); overrides --preset")
    parser.add_argument("--portrait", default=None, help="image of the face a portrait model (FlashHead) animates")
    parser.add_argument("--out", default="demo-out", help="output directory (default: ./demo-out)")
    parser.add_argument("--serve", action="store_true",
                        help="serve the web page and wait for a browser instead of the in-process client")
    parser.add_argument("--port", type=arguments.port, default=8080, help="HTTP port with --serve (default: 8080)")
    parser.add_argument("--hosting", default="inproc", choices=("inproc", "processes"),
                        help="inproc: every stage in this process (default); processes: diffusion and decode "
                             "in processes of their own")
    arguments.renamed(parser, "--placement", "--hosting")
    parser.add_argument("--gpus", metavar="LAYOUT", default=None,
                        help="GPU layout: diffusion TP ranks + decoder, e.g. 1 (one GPU for both), 3+1 "
                             "(pipeline/runtime/layouts.py); stages in processes of their own")
    parser.add_argument("--script", default=None,
                        help='JSON file: [{"user": "...", "agent": "...", "barge_in_after_s": null}, ...]')
    parser.add_argument("--weights", default="packaged",
                        help="weights file (presets) or released folder (FlashHead), 'packaged' (the trained weights "
                             "shipped for the preset, if any) or 'random' (seeded random weights)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="give up after this many seconds (default: 60 + 30 per turn)")
    parser.add_argument("--otel", default=None, choices=("none", "console", "otlp"),
                        help="export OpenTelemetry spans (conversation -> turn -> stages); default: the OTEL_* environment "
                             "(OTEL_TRACES_EXPORTER, OTEL_EXPORTER_OTLP_ENDPOINT), else none")
    parser.add_argument("--otlp-endpoint", default=None,
                        help="OTLP/HTTP traces endpoint for --otel otlp (default: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT)")
    parser.add_argument("--metrics-port", type=arguments.port, default=None,
                        help="serve Prometheus metrics (step time, playout depth, underruns, fps) on this port")
    parser.add_argument("--metrics-host", default="127.0.0.1", help="the metrics listener's address")
    parser.add_argument("--agent-pace", choices=AGENT_PACES, default="realtime",
                        help="how the scripted agent streams its reply: realtime (20 ms per 20 ms, default) or "
                             "synthesized (as TTS services push it: up to ingest's horizon ahead of real time -- max_ahead_s, or a chunk where longer)")
    parser.add_argument("--hear", action=argparse.BooleanOptionalAction, default=True,
                        help="run the scripted user's speech through the agent's recogniser (default); "
                             "--no-hear: the agent hears the script's line, and no recogniser is loaded")
    parser.add_argument("--verbose", action="store_true",
                        help="structured logs on stderr, at $CHARSTREAM_LOG_LEVEL (default info)")


@dataclass
class DemoPlan:
    config: PipelineConfig
    script: list[dict]
    weights: str | None
    weights_note: str
    out: Path
    portrait: np.ndarray | None = None  # the face a portrait model animates


class ClientThread:
    """The in-process aiortc client on an event loop of its own, in its own thread.

    On one loop with the server and the pipeline, the client's per-packet work (decryption, jitter
    buffer, decode, mp4 encode, frame reports) queues behind theirs; on a starved CPU that backlog
    reached seconds, enough for ICE consent checks (0.5 s timeout) to expire and the call to drop.
    Its own loop keeps each side's packets flowing; they still share the process and the GIL.
    """

    def __init__(self, record_path: Path, fps: int) -> None:
        from charstream.pipeline.web.client import EgressClient

        self.client = EgressClient(record_path=record_path, fps=fps)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="demo-client", daemon=True)
        self.thread.start()

    async def _call(self, coroutine):
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coroutine, self.loop))

    async def connect(self, url: str, token: str) -> None:
        await self._call(self.client.connect(url, token))

    async def close(self) -> None:
        """Hang up and finish session.mp4; the thread ends."""
        try:
            await self._call(self.client.close())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            await asyncio.to_thread(self.thread.join)
            self.loop.close()


def plan(args: argparse.Namespace) -> DemoPlan:
    from charstream.model.families import get_family
    from charstream.model.weights import packaged_weights
    from charstream.stages.agents.scripted import DEFAULT_SCRIPT

    name = args.model or args.preset
    get_family(name)  # an unknown model fails here, before anything starts
    if args.script:
        try:
            script = json.loads(Path(args.script).read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{args.script}: not JSON ({e})") from None
        if not isinstance(script, list) or not script or not all(
                isinstance(line, dict) and {"user", "agent"} <= set(line) for line in script):
            raise ValueError(f"{args.script}: expected a non-empty JSON list of {{'user', 'agent'}} objects")
    else:
        script = [{"user": line.user, "agent": line.agent} for line in DEFAULT_SCRIPT]
    turns = args.turns if args.turns is not None else len(script)
    if turns < 1:
        raise ValueError("--turns must be at least 1")
    script = [script[i % len(script)] for i in range(turns)]

    portrait = None
    if get_family(name).generation_mode == "chunk_motion":
        weights, portrait = arguments.model_choice(name, args.weights, args.portrait)
        note = f"{name}: weights {weights}" if weights else f"{name}: seeded random weights (asked for)"
    elif args.portrait is not None:
        raise ValueError(f"--portrait: model {name!r} animates its own character, not a portrait")
    elif args.weights == "random":
        weights, note = None, f"seeded random weights for {name!r} (asked for)"
    elif args.weights == "packaged":
        path = packaged_weights(name)
        weights = str(path) if path else None
        note = (f"trained weights {path}" if path else
                f"seeded random weights: no trained {name!r} weights ship with this package yet, "
                "so the character is noise that moves with the speech")
    else:
        if not Path(args.weights).is_file():
            raise ValueError(f"--weights {args.weights}: no such file")
        weights, note = args.weights, f"weights {args.weights}"

    out = Path(args.out)
    config = PipelineConfig(preset=name, hosting=args.hosting)
    if args.gpus:
        import torch

        from charstream.pipeline.runtime.layouts import apply_layout

        config = apply_layout(config, args.gpus, gpus_available=torch.cuda.device_count())
    config.tracing.jsonl_path = str(out / "trace.jsonl")
    config.tracing.otel_exporter = args.otel
    config.tracing.otlp_endpoint = args.otlp_endpoint
    config.tracing.prometheus_port = args.metrics_port
    config.tracing.prometheus_host = args.metrics_host
    config.ingest.script = script
    config.ingest.agent_pace = args.agent_pace
    config.ingest.scripted_recognizer = args.hear
    # In-process, the user is scripted (and heard by the recogniser); with --serve the browser's
    # user talks to the built-in agent.
    config.ingest.adapter = "listening" if args.serve else "scripted"
    # The user speaks once the stream is up (model warm-up, first chunks buffered, WebRTC): the
    # recording then holds the whole conversation, even on a slow machine.
    config.ingest.lead_in_s = 3.0
    config.egress.port = args.port if args.serve else 0
    # Client reports are matched to released frames by index: keep 10 s of them, so a client that
    # lags on a busy machine still gets its turns stamped.
    config.playout.history_frames = 10 * config.timeline.fps
    return DemoPlan(config, script, weights, note, out, portrait)


class Progress:
    """Turns as they happen: one line when the character starts answering, one with the latencies."""

    def __init__(self, script: list[dict] | None, turns: int, session_id: str, fps: int) -> None:
        self.script = script
        self.frame_fps = fps  # the session's timeline
        self.session_id = session_id
        self.fps: list[float] = []  # playout's recent-fps gauge at every tick
        self.bar = tqdm(total=turns, unit="turn", desc="conversation", dynamic_ncols=True,
                        bar_format="{desc}: {n_fmt}/{total_fmt} turns |{bar}| {elapsed} {postfix}")

    def speaking(self, turn_id: int, answer: int) -> None:
        """The character's ``answer``-th reply (0-based) starts: it answers script line ``answer``
        (scripted user), or whatever the browser's user said."""
        if self.script is None:
            tqdm.write(f"turn {turn_id}: the character answers")
            return
        line = self.script[answer]["user"] if answer < len(self.script) else "?"
        tqdm.write(f"turn {turn_id}: user said “{_short(line)}” → the character answers")

    def turn(self, record: TurnRecord) -> None:
        seg = intervals(record.stamps, SEGMENTS)
        parts = " · ".join(f"{name} {seg[name] * 1e3:.0f} ms" for name in SEGMENTS if name in seg)
        heard = f" · heard “{_short(record.heard)}”" if record.heard is not None else ""
        tqdm.write(f"turn {record.turn_id}: {parts}{heard}" + ("" if record.complete else " (incomplete)"))
        self.bar.update(1)

    def tick(self, frames: int) -> None:
        fps = REGISTRY.get_sample_value("charstream_fps", {"session": self.session_id})
        self.fps.append(fps or 0.0)
        underruns = REGISTRY.get_sample_value("charstream_underruns_total", {"session": self.session_id})
        self.bar.set_postfix_str(f"{frames / self.frame_fps:.1f} s played · {fps or 0:.1f} fps · "
                                 f"{int(underruns or 0)} underruns", refresh=True)

    def close(self) -> None:
        self.bar.close()


def _short(text: str, n: int = 48) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


async def watch_conversation(session, turns: int, progress: Progress) -> None:
    """Until the last turn's reply has played out and every turn has its trace (or the session ends)."""
    from charstream.stages.playout.output import PlayoutClosed

    output = session.output
    fps = output.timeline.fps
    spoken: set[int] = set()
    index = quiet = 0
    quiet_since: float | None = None
    try:
        while not session.done.is_set():
            frame = await output.frame_at(index)
            index = frame.index + 1
            if frame.first_speaking and frame.trace is not None:
                progress.speaking(frame.trace.turn_id, len(spoken))  # turn ids also count unanswered utterances
                spoken.add(frame.trace.turn_id)
            quiet = 0 if frame.speaking else quiet + 1
            if index % fps == 0:
                progress.tick(index)
            if len(spoken) >= turns and quiet >= QUIET_S * fps:
                # The last reply has played out; the client's reports of it may still be on their way.
                quiet_since = quiet_since or time.monotonic()
                if session.tracer.exported >= turns or time.monotonic() - quiet_since > CLIENT_GRACE_S:
                    return
    except PlayoutClosed:
        return


async def wait_for_client(client, peer, end_index: int, samples_per_frame: int,
                          timeout: float = CLIENT_CATCH_UP_S) -> None:
    """Until the client has received video and audio up to output frame ``end_index``: on a busy
    machine it lags, and session.mp4 must hold the whole conversation."""
    if peer is None or peer.video is None:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if peer.state == "closed":  # the session ended (a stage died): nothing more will reach the client
            return
        first = peer.video.start.index  # both tracks start at this output frame
        last_video = client.video[-1] if client.video else None  # appended by the client's thread
        video = peer.video.frame_index(last_video.rtp) if last_video is not None else None
        audio_samples = client.audio_samples
        if first is not None and video is not None and video >= end_index \
                and first + audio_samples // samples_per_frame >= end_index:
            return
        await asyncio.sleep(0.1)
    tqdm.write(f"charstream demo: the client had not caught up after {timeout:.0f} s; session.mp4 ends early")


async def run_demo(args: argparse.Namespace) -> int:
    from charstream.pipeline.runtime.process import MemoryTrimmer
    from charstream.pipeline.session import LiveSession, session_factory
    from charstream.pipeline.trace_report import render_table, write_report
    from charstream.pipeline.web.server import EgressServer

    demo = plan(args)
    out = demo.out
    out.mkdir(parents=True, exist_ok=True)
    for name in ("trace.jsonl", "report.md", "report.json", "waterfall.png", "playout.json", "session.mp4"):
        (out / name).unlink(missing_ok=True)
    print(f"charstream demo: {len(demo.script)} turns, preset {args.preset!r}, {demo.weights_note}")

    sessions: list[LiveSession] = []
    ready = asyncio.Event()

    def on_session(session: LiveSession) -> None:
        sessions.append(session)
        ready.set()

    tracing = demo.config.tracing
    if tracing.prometheus_port is not None:
        serve_metrics(tracing.prometheus_port, tracing.prometheus_host)
        print(f"metrics on http://{tracing.prometheus_host}:{tracing.prometheus_port}/metrics")
    server = EgressServer(demo.config.egress, session_factory(demo.config, demo.weights, on_session,
                                                                   portrait=demo.portrait))
    url = await server.start()
    trimmer = MemoryTrimmer(demo.config.egress.memory_trim_s)  # this process owns the serving loop
    trimmer.start()
    client = None
    timeout = args.timeout or 60 + 30 * len(demo.script)
    progress: Progress | None = None
    try:
        if args.serve:
            print(f"open {url}/?code={server.issue_code()} in a browser (a one-time link), press Connect and talk "
                  f"to the character (the built-in agent, offline; the demo ends after {len(demo.script)} answers)")
            await ready.wait()
        else:
            _, token = server.create_session()
            client = ClientThread(out / "session.mp4", demo.config.timeline.fps)
            await client.connect(url, token)
        session = sessions[0]
        progress = Progress(None if args.serve else demo.script, len(demo.script), session.session_id,
                            session.output.timeline.fps)
        session.tracer.on_turn = progress.turn
        try:
            await asyncio.wait_for(watch_conversation(session, len(demo.script), progress), timeout)
            if client is not None:
                await wait_for_client(client.client, server.sessions.get(client.client.session_id),
                                      session.output.next_index, session.output.timeline.samples_per_frame)
        except TimeoutError:
            tqdm.write(f"charstream demo: gave up after {timeout:.0f} s")
    finally:
        if progress is not None:
            progress.close()
        if client is not None:
            await client.close()  # finishes session.mp4
        await trimmer.stop()
        await server.stop()  # closes the session: its pipeline stops, its tracer flushes
        for session in sessions:
            await session.stop("demo finished")

    result = sessions[0].result if sessions else None
    if result is None:
        print("charstream demo: no session ran")
        return 1
    if not result.ok:
        print(f"charstream demo: the session failed: {result.error}")
    playout = sessions[0].stages.get("playout")
    if playout is None:  # the session failed before its playout started: nothing was played
        return 1
    played = sessions[0].output.next_index
    # Playout always runs in this process: its own counts (the metrics registry misses them when the
    # model stages are processes of their own).
    stats = playout.stats
    fps = progress.fps[2:] if progress is not None else []  # one reading a second, past the first two (ramp)
    print(f"charstream demo: {played} frames played ({played / sessions[0].output.timeline.fps:.1f} s of media), {stats.underruns} underruns "
          f"({stats.underrun_frames} frames held), playout fps min {min(fps, default=0):.1f} / median "
          f"{statistics.median(fps) if fps else 0:.1f}; {stats.rollbacks} rollbacks: {stats.late_speech} with the "
          f"speech late, {stats.kept_chunks} chunks kept, {stats.rolled_back_chunks} dropped")
    print("underruns by cause (frames held): " + ", ".join(
        f"{cause} {counts.count} ({counts.frames})" for cause, counts in stats.by_cause.items()))
    (out / "playout.json").write_text(json.dumps({**stats.summary(), "frames_played": played}, indent=1) + "\n",
                                      encoding="utf-8")
    summary = write_report(out / "trace.jsonl", out)
    print(render_table(summary))
    files = ["trace.jsonl", "report.md", "report.json", "waterfall.png", "playout.json"] + (
        [] if args.serve else ["session.mp4"])
    print("wrote " + ", ".join(str(out / f) for f in files))
    if not result.ok or summary.complete < len(demo.script):
        print(f"charstream demo: {summary.complete} of {len(demo.script)} turns have all seven stamps")
        return 1
    return 0


def run(args: argparse.Namespace) -> int:
    configure_logging(None if args.verbose else "error")  # the progress display shows underruns
    try:
        return asyncio.run(run_demo(args))
    except (ValueError, OSError) as e:
        print(f"charstream demo: {e}")
        return 2
