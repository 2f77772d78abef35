"""charstream: real-time serving for live conversational video characters.

The public API, importable from the top (each name is imported on first use, so ``import charstream``
stays light):

- ``PipelineConfig``, ``get_preset``, ``PRESETS`` — typed session config and model presets;
- ``LiveSession`` — one live character session (the whole stage graph);
- ``EmbeddedSession`` — a session driven from inside a voice-agent framework;
- ``CharstreamVideoService`` — the Pipecat service (extra ``pipecat``);
- ``CharstreamVideoGenerator`` — the LiveKit Agents ``VideoGenerator`` (extra ``livekit``);
- ``ExternalAgentClient`` — your own agent, over charstream's ZeroMQ ingest protocol.

The packages under it run one way (docs/ARCHITECTURE.md, Layers): ``charstream.pipeline`` (the application)
→ ``charstream.stages`` → ``charstream.model`` and ``charstream.transport`` → ``charstream.kernels``,
with ``charstream.timeline`` (the media clock) at the bottom.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import Any

try:
    __version__ = version("charstream")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0.0.0+unknown"

_API = {
    "PipelineConfig": "charstream.pipeline.config",
    "get_preset": "charstream.model.config",
    "PRESETS": "charstream.model.config",
    "LiveSession": "charstream.pipeline.session",
    "EmbeddedSession": "charstream.pipeline.integrations.embedded",
    "CharstreamVideoService": "charstream.pipeline.integrations.pipecat",
    "CharstreamVideoGenerator": "charstream.pipeline.integrations.livekit",
    "ExternalAgentClient": "charstream.pipeline.integrations.agent_client",
}

__all__ = ["__version__", *_API]


def __getattr__(name: str) -> Any:
    module = _API.get(name)
    if module is None:
        raise AttributeError(f"module 'charstream' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
