"""The ``charstream`` command line.

Each command lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int``;
modules are imported only when their command runs, so ``charstream --help`` stays fast and a
command's heavy imports (torch, aiortc) cost nothing to the others.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from charstream import __version__
from charstream.logs import log_level

# (command words, module, one-line help)
COMMANDS: list[tuple[tuple[str, ...], str, str]] = [
    (("demo",), "charstream.pipeline.demo", "live character demo on CPU: scripted agent -> WebRTC client, writes trace + mp4"),
    (("serve",), "charstream.pipeline.serve", "serve the web page and WebRTC endpoint for a browser session"),
    (("engine",), "charstream.pipeline.runtime.engine", "the model engine: hosts many sessions' model stages in one process (hosting engine)"),
    (("fleet", "status"), "charstream.pipeline.fleet.commands", "a fleet's nodes, sessions, free layouts and health"),
    (("fleet", "drain"), "charstream.pipeline.fleet.commands", "stop a fleet node taking new sessions"),
    (("bench", "transport"), "charstream.pipeline.bench.transport", "ZeroMQ channel latency, throughput and backpressure"),
    (("bench", "fuzz"), "charstream.pipeline.bench.fuzz", "malformed input into every network-reading socket: crashes, hangs, escapes"),
    (("bench", "fleet"), "charstream.pipeline.bench.fleet", "concurrent test-card sessions through a local Ray fleet's front door"),
    (("bench", "capacity"), "charstream.pipeline.bench.capacity", "concurrent live sessions on one host: fps, latency, where it saturates"),
    (("bench", "soak"), "charstream.pipeline.bench.soak", "hours of use: RSS/fds/threads/shm per session and per minute, fps held"),
    (("bench", "model"), "charstream.pipeline.bench.model", "CPU step and decode time of a model preset"),
    (("bench", "gpu"), "charstream.pipeline.bench.gpu", "GPU step breakdown, kernels, decoder, against the reference numbers"),
    (("bench", "egress"), "charstream.pipeline.bench.egress", "WebRTC delivery to Chromium and aiortc, and software encode per frame"),
    (("bench", "ingest"), "charstream.pipeline.bench.ingest", "VAD end-of-speech error and cost, and the resampler's quality"),
    (("bench", "mic-sessions"), "charstream.pipeline.bench.mic_sessions", "browser sessions on a fake microphone: heard, answered, the user's wait"),
    (("bench", "asr"), "charstream.pipeline.bench.asr", "the agent's speech recognisers on held-out speech: WER and time to the final transcript"),
    (("bench", "chunk"), "charstream.pipeline.bench.chunk", "a chunk-motion model's (FlashHead's) whole chunk by part, and sessions side by side"),
    (("bench", "batch"), "charstream.pipeline.bench.batch", "GPU: one batched diffusion forward for K sessions against K separate steps"),
    (("model", "info"), "charstream.pipeline.model_info", "parameters, per-rank memory and FLOPs of a preset; a model family's weights folder checked"),
    (("trace", "report"), "charstream.pipeline.trace_report", "median/p90 per trace segment and a waterfall PNG"),
    (("train",), "charstream.pipeline.training.train", "train the tiny character model"),
    (("lipsync",), "charstream.pipeline.quality.lipsync", "lip-sync confidence and offset of a video or session"),
    (("quality",), "charstream.pipeline.quality.gate", "quality gate: candidate vs baseline against rerun variance"),
]


def build_parser() -> tuple[argparse.ArgumentParser, dict[tuple[str, ...], argparse.ArgumentParser]]:
    parser = argparse.ArgumentParser(
        prog="charstream",
        description="Real-time serving for live conversational video characters.",
    )
    parser.add_argument("--version", action="version", version=f"charstream {__version__}")
    top = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    groups: dict[str, argparse._SubParsersAction] = {}
    leaves: dict[tuple[str, ...], argparse.ArgumentParser] = {}
    for words, module, help_text in COMMANDS:
        if len(words) == 1:
            sub = top.add_parser(words[0], help=help_text, description=help_text)
        else:
            if words[0] not in groups:
                group_parser = top.add_parser(words[0], help=f"{words[0]} commands")
                groups[words[0]] = group_parser.add_subparsers(dest="subcommand", metavar="SUBCOMMAND", required=True)
            sub = groups[words[0]].add_parser(words[1], help=help_text, description=help_text)
        sub.set_defaults(_module=module)
        leaves[words] = sub
    return parser, leaves


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser, leaves = build_parser()
    # Only the chosen command's module is imported; it adds its own arguments to its parser.
    words = tuple(a for a in argv[:2] if not a.startswith("-"))
    for key in (words[:2], words[:1]):
        if key in leaves:
            module = importlib.import_module(leaves[key].get_default("_module"))
            module.add_arguments(leaves[key])
            break
    args = parser.parse_args(argv)
    try:  # every command logs, in this process and the ones it starts: a bad level is said once, here
        log_level()
    except ValueError as e:
        parser.error(str(e))
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
