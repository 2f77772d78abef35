"""``charstream serve``: the web page and WebRTC endpoint, one session per browser connection.

    charstream serve [--source pipeline|testcard] [--port 8080] [--codec VP8|H264] [--config FILE]
                     [--cluster auto|ADDRESS]

It prints a one-time link to the page (``/?code=...``: the page trades the code for the server
key, so the key never lands in a URL; with ``--key`` you may also type the key into the page);
each Connect reserves a session and streams it. Logs are JSON lines on stderr. ``--source pipeline`` (the default) runs the full session graph per
connection (``pipeline.session.session_factory``: the character model, the configured agent
adapter; with the default scripted agent the user is scripted too and the microphone is not
used). ``--source testcard`` needs no model: a test card whose "character" answers each end of
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

from charstream.pipeline.config import PipelineConfig
from charstream.stages.egress.server import CODECS, EgressServer, SessionFactory

from charstream.logs import configure_logging


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--source", choices=["pipeline", "testcard"], default="pipeline",
                        help="what each session streams (default: the full pipeline)")
    parser.add_argument("--config", type=Path, help="PipelineConfig as TOML or JSON")
    parser.add_argument("--preset", help="model preset (overrides the config)")
    parser.add_argument("--adapter", help="agent adapter: scripted | zmq | pipecat | livekit (overrides the config)")
    parser.add_argument("--host", help="listen address (default from config: 127.0.0.1)")
    parser.add_argument("--port", type=int, help="listen port (default from config: 8080; 0 picks a free one)")
    parser.add_argument("--codec", choices=sorted(CODECS), help="video codec (default from config: VP8)")
    parser.add_argument("--key", help="server key the page must present (default: random, printed)")
    parser.add_argument("--gpus", metavar="LAYOUT",
                        help="GPU layout of each session: diffusion TP ranks + decoder, e.g. 3+1, 4+1, 6+1 "
                             "(pipeline/placement.py); sets devices and spawns one process per rank; "
                             "with --cluster, the layout each session reserves on a node")
    parser.add_argument("--cluster", metavar="ADDRESS",
                        help="front door of a fleet: run each session on a node of this Ray cluster "
                             "('auto': the cluster this host belongs to); needs charstream[fleet]")


def load_config(args: argparse.Namespace) -> PipelineConfig:
    data = {}
    if args.config is not None:
        text = args.config.read_text()
        data = json.loads(text) if args.config.suffix == ".json" else tomllib.loads(text)
    config = PipelineConfig.from_dict(data)
    if args.preset:
        config.preset = args.preset
    if args.adapter:
        config.ingest.adapter = args.adapter
    for name in ("host", "port", "codec"):
        if getattr(args, name) is not None:
            setattr(config.egress, name, getattr(args, name))
    if args.gpus and args.cluster:
        config.fleet.layout = args.gpus  # placed on a node, not here
    elif args.gpus:
        import torch
        from charstream.pipeline.placement import apply_placement

        config = apply_placement(config, args.gpus, gpus_available=torch.cuda.device_count())
    return config


def make_factory(source: str, config: PipelineConfig) -> SessionFactory:
    from charstream.pipeline.session import session_factory

    return session_factory(config, testcard=source == "testcard")


async def serve(config: PipelineConfig, source: str, key: str | None, cluster: str | None = None) -> None:
    configure_logging()
    if cluster is None:
        server = EgressServer(config.egress, make_factory(source, config), access_key=key)
    else:
        from charstream.pipeline.fleet.frontdoor import FrontDoor, join_cluster

        join_cluster(cluster)
        server = FrontDoor(config, source, access_key=key)
    url = await server.start()
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
        await server.stop()


def run(args: argparse.Namespace) -> int:
    try:
        config = load_config(args)
        asyncio.run(serve(config, args.source, args.key, args.cluster))
    except ModuleNotFoundError as e:
        if e.name != "ray":
            raise
        print("charstream serve: --cluster needs Ray: pip install 'charstream[fleet]'")
        return 2
    except (ValueError, OSError, tomllib.TOMLDecodeError) as e:
        print(f"charstream serve: {e}")
        return 2
    return 0
