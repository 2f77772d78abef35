"""``charstream serve``: the web page and WebRTC endpoint, one session per browser connection.

    charstream serve [--source pipeline|testcard] [--adapter listening|zmq|...] [--out DIR]
                     [--port 8080] [--codec VP8|H264] [--config FILE] [--cluster auto|ADDRESS]
                     [--metrics-port 9464 [--metrics-host 127.0.0.1]] [--engine ipc:///tmp/charstream-engine.sock]

It prints a one-time link to the page (``/?code=...``: the page trades the code for the server
key, so the key never lands in a URL; with ``--key`` you may also type the key into the page);
each Connect reserves a session and streams it. Logs are JSON lines on stderr. ``--source
pipeline`` (the default) runs the full session graph per connection
(``pipeline.session.session_factory``: the character model and an agent of its own): by default
the built-in agent (``listening``), which hears the browser's microphone, recognises it offline
and answers; ``--adapter zmq`` swaps in a real agent over a socket (Pipecat and LiveKit host charstream
inside their own pipelines instead: ``pipeline/integrations/``). ``--out DIR`` writes each
session's ``trace.jsonl``, ``report.md``/``report.json`` and ``waterfall.png`` into
``DIR/<session id>/`` (the report when the session ends). ``--source testcard`` needs no model: a test card whose "character" answers each end of
your speech (heard by silero-vad on your microphone) at once, which exercises rollback, the
clock and the latency overlay end to end. ``--cluster`` makes it a fleet's front door: each
session runs on a node of that Ray cluster (``pipeline/fleet/``, docs/FLEET.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import tomllib
from pathlib import Path

import numpy as np
import structlog

from charstream.logs import configure_logging
from charstream.pipeline import arguments
from charstream.pipeline.config import PipelineConfig
from charstream.pipeline.runtime.process import MemoryTrimmer
from charstream.pipeline.web.server import CODECS, EgressServer, SessionFactory
from charstream.stages.ingest.adapters import ADAPTERS
from charstream.stages.ingest.external import AgentHub
from charstream.stages.shared.metrics import serve_metrics

log = structlog.get_logger("serve")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--source", choices=["pipeline", "testcard"], default="pipeline",
                        help="what each session streams (default: the full pipeline)")
    parser.add_argument("--config", type=Path, help="PipelineConfig as TOML or JSON")
    parser.add_argument("--preset", help="model preset (overrides the config)")
    parser.add_argument("--model", help="model to serve: a preset or a family (flashhead-pro: with --weights and "
                                        "--portrait); overrides the config's preset")
    parser.add_argument("--weights", help="the model's weights: a file (presets), its released folder (FlashHead) or "
                                          "'random' (seeded random weights); default: the weights shipped, if any")
    parser.add_argument("--portrait", help="image of the face a portrait model (FlashHead) animates, encoded once a session")
    parser.add_argument("--adapter", help="agent adapter: listening (the built-in agent, default) | zmq | scripted "
                                          "(overrides the config; Pipecat and LiveKit run charstream inside their "
                                          "own pipelines: docs/AGENTS.md)")
    parser.add_argument("--out", type=Path, help="write each session's trace, report and waterfall into OUT/<session>/")
    parser.add_argument("--host", help="listen address (default from config: 127.0.0.1)")
    parser.add_argument("--port", type=arguments.port, help="listen port (default from config: 8080; 0 picks a free one)")
    parser.add_argument("--codec", choices=sorted(CODECS), help="video codec (default from config: VP8)")
    parser.add_argument("--key", help="server key the page must present (default: random, printed)")
    parser.add_argument("--metrics-port", type=arguments.port,
                        help="serve Prometheus metrics on this port (default from config: tracing.prometheus_port)")
    parser.add_argument("--metrics-host", help="the metrics listener's address (default from config: 127.0.0.1)")
    parser.add_argument("--gpus", metavar="LAYOUT",
                        help="GPU layout of each session: diffusion TP ranks + decoder, e.g. 3+1, 4+1, 6+1 "
                             "(pipeline/runtime/layouts.py); sets devices and spawns one process per rank; "
                             "with --cluster, the layout each session reserves on a node")
    parser.add_argument("--batch-sessions", type=int, metavar="N",
                        help="batch the diffusion steps (FlashHead: chunks), the decoding and FlashHead's audio "
                             "encodes of up to N sessions of this process into one forward each "
                             "(diffusion, decode and conditioning.batch_sessions; default from config: 1 = off)")
    parser.add_argument("--engine", metavar="ENDPOINT",
                        help="host each session's model stages in the model engine running at ENDPOINT "
                             "(`charstream engine`, hosting engine: its devices and batching)")
    parser.add_argument("--cluster", metavar="ADDRESS",
                        help="front door of a fleet: run each session on a node of this Ray cluster "
                             "('auto': the cluster this host belongs to); needs charstream[fleet]")


def _override(data: dict, key: str, value: object) -> None:
    """``data``'s dotted ``key`` (e.g. ``egress.port``) set to ``value``, its sections made as needed."""
    *sections, name = key.split(".")
    for section in sections:
        data = data.setdefault(section, {})
        if not isinstance(data, dict):
            raise ValueError(f"config {section}: expected a table, got {type(data).__name__}")
    data[name] = value


def load_config(args: argparse.Namespace) -> PipelineConfig:
    """The config file, with the options given on the command line over its keys, built and checked as one."""
    data = {}
    if args.config is not None:
        text = args.config.read_text()
        data = json.loads(text) if args.config.suffix == ".json" else tomllib.loads(text)
    if args.engine is not None and (args.gpus or args.batch_sessions is not None):
        raise ValueError("--engine: the engine's own --gpus and --batch-sessions apply, not serve's")
    if args.model is not None and args.preset is not None:
        raise ValueError("--model and --preset name the same thing: give one")
    overrides = {"preset": args.model or args.preset, "ingest.adapter": args.adapter, "egress.host": args.host,
                 "egress.port": args.port, "egress.codec": args.codec, "diffusion.batch_sessions": args.batch_sessions,
                 "decode.batch_sessions": args.batch_sessions,
                 "conditioning.batch_sessions": args.batch_sessions, "tracing.prometheus_port": args.metrics_port,
                 "tracing.prometheus_host": args.metrics_host, "engine_endpoint": args.engine,
                 "hosting": None if args.engine is None else "engine"}
    for key, value in overrides.items():
        if value is not None:
            _override(data, key, value)
    config = PipelineConfig.from_dict(data)
    if config.ingest.adapter not in ADAPTERS:  # pipecat / livekit sessions are made inside their frameworks
        raise ValueError(f"ingest adapter {config.ingest.adapter!r}: serve's sessions make their agent from one of "
                         f"{sorted(ADAPTERS)}")
    if args.gpus and args.cluster:
        config.fleet.layout = args.gpus  # placed on a node, not here
    elif args.gpus:
        import torch

        from charstream.pipeline.runtime.layouts import apply_layout

        config = apply_layout(config, args.gpus, gpus_available=torch.cuda.device_count())
    return config


def make_factory(source: str, config: PipelineConfig, out: Path | None = None,
                 agent_hub: AgentHub | None = None, weights: str | None = "packaged",
                 portrait: np.ndarray | None = None) -> SessionFactory:
    from charstream.pipeline.session import LiveSession, session_factory
    from charstream.stages.agents.asr import make_recognizer

    if config.ingest.adapter == "listening":
        # its model loads once per process (Moonshine's ~0.7 s, ~6 s the first time on a machine): now, not in
        # the first session's start, where it would hold up that session's WebRTC handshake and clocks
        make_recognizer(config.ingest.recognizer)
    reports: set[asyncio.Task] = set()

    def on_session(session: LiveSession) -> None:
        if session.agent_token is not None:
            print(f"charstream serve: session {session.session_id} waits for an agent at {agent_hub.bound_endpoint} "
                  f"(hello with session={session.agent_token}, or without one to take the oldest waiting)", flush=True)
        if out is not None:
            task = asyncio.create_task(write_session_report(session, out / session.session_id))
            reports.add(task)
            task.add_done_callback(reports.discard)

    return session_factory(config, weights, on_session=on_session, testcard=source == "testcard", out_dir=out,
                           agent_hub=agent_hub, portrait=portrait)


async def write_session_report(session, directory: Path) -> None:
    """Once ``session`` has ended: its report and waterfall beside its trace."""
    from charstream.pipeline.trace_report import write_report

    await session.done.wait()
    trace = directory / "trace.jsonl"
    if not trace.is_file():  # no turn was traced
        return
    try:
        summary = await asyncio.to_thread(write_report, trace, directory)
    except (OSError, ValueError) as e:
        log.error("session_report_failed", session_id=session.session_id, error=str(e))
        return
    log.info("session_report", session_id=session.session_id, directory=str(directory), turns=summary.complete)


async def serve(config: PipelineConfig, source: str, key: str | None, cluster: str | None = None,
                out: Path | None = None, weights: str | None = "packaged", portrait: np.ndarray | None = None) -> None:
    configure_logging()
    tracing = config.tracing
    if tracing.prometheus_port is not None:  # before any session spawns its stage processes
        serve_metrics(tracing.prometheus_port, tracing.prometheus_host)
        print(f"charstream serve: metrics on http://{tracing.prometheus_host}:{tracing.prometheus_port}/metrics",
              flush=True)
    agent_hub = None
    if cluster is None:
        if config.ingest.adapter == "zmq" and source == "pipeline":  # one agent socket for every session
            agent_hub = AgentHub(config.ingest)
            await agent_hub.start()
        server = EgressServer(config.egress, make_factory(source, config, out, agent_hub, weights, portrait),
                              access_key=key)
    else:
        from charstream.pipeline.fleet.frontdoor import FrontDoor, join_cluster

        join_cluster(cluster)
        server = FrontDoor(config, source, access_key=key)
    url = await server.start()
    trimmer = MemoryTrimmer(config.egress.memory_trim_s)  # this process owns the serving loop
    trimmer.start()
    where = "" if cluster is None else f", fleet {config.fleet.layout} on {cluster}"
    print(f"charstream serve ({source}, {config.egress.codec}{where}): open {url}/?code={server.issue_code()} "
          "(a one-time link)", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        print("charstream serve: stopping", flush=True)
        await trimmer.stop()
        await server.stop()
        if agent_hub is not None:
            await agent_hub.close()


def run(args: argparse.Namespace) -> int:
    try:
        config = load_config(args)
        if args.out is not None and args.cluster is not None:
            raise ValueError("--out writes the sessions of this host; with --cluster they run on the nodes")
        weights, portrait = arguments.model_choice(config.preset, args.weights or "packaged", args.portrait)
        if portrait is not None and args.cluster is not None:
            raise ValueError(f"--cluster: model {config.preset!r} is served on this host only so far")
        asyncio.run(serve(config, args.source, args.key, args.cluster, args.out, weights, portrait))
    except ModuleNotFoundError as e:
        if e.name != "ray":
            raise
        print("charstream serve: --cluster needs Ray: pip install 'charstream[fleet]'")
        return 2
    except (ValueError, OSError, tomllib.TOMLDecodeError) as e:
        print(f"charstream serve: {e}")
        return 2
    return 0
