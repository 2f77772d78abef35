"""Typed configuration for a charstream session, one section per concern.

Every field has a default that runs the embedded CPU demo; ``from_dict`` builds a config from
plain data (JSON/TOML) and rejects unknown keys with the path of the offending key.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from charstream.config_checks import CheckedSection, within
from charstream.model.config import ModelConfig, get_preset
from charstream.pipeline.fleet.config import FleetConfig
from charstream.stages.config import (
    ConditioningConfig,
    DecodeConfig,
    DiffusionConfig,
    EgressConfig,
    IngestConfig,
    PlayoutConfig,
    TracingConfig,
)
from charstream.timeline import Timeline
from charstream.transport.config import TransportConfig

HOSTINGS = ("inproc", "processes", "engine")  # PipelineConfig.hosting


@dataclass
class PipelineConfig(CheckedSection):
    preset: str = "tiny"
    # inproc (one process) | processes (edge, diffusion ranks, decoder) | engine (the model stages in a
    # running engine process shared by many sessions: pipeline/runtime/engine.py, `charstream engine`)
    hosting: str = "inproc"
    engine_endpoint: str = "ipc:///tmp/charstream-engine.sock"  # hosting engine: the engine's socket (ipc or loopback tcp)
    # How long a thread running Python keeps the GIL from one that asks for it (sys.setswitchinterval),
    # set by the process that serves sessions: a model thread retakes the GIL after each CUDA call of
    # its step (~15), and at Python's 5 ms each retake waits for the event loop's thread to be forced off.
    gil_switch_interval_ms: float = field(default=0.5, metadata=within(0.01, 1000))
    # Every serving process (the server, each stage process, an engine) imports what its sessions run,
    # then freezes its heap out of Python's full collections (pipeline/runtime/heap.py): one walked ~285,000
    # objects holding the GIL 110-156 ms.
    freeze_heap: bool = True
    transport: TransportConfig = field(default_factory=TransportConfig)
    ingest: IngestConfig = field(default_factory=IngestConfig)
    conditioning: ConditioningConfig = field(default_factory=ConditioningConfig)
    diffusion: DiffusionConfig = field(default_factory=DiffusionConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    playout: PlayoutConfig = field(default_factory=PlayoutConfig)
    egress: EgressConfig = field(default_factory=EgressConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)
    fleet: FleetConfig = field(default_factory=FleetConfig)  # charstream serve --cluster

    def check_together(self) -> None:
        if self.hosting not in HOSTINGS:  # anything else would run as "processes"
            raise ValueError(f"hosting must be one of {', '.join(HOSTINGS)}, got {self.hosting!r}")
        _ = self.timeline  # an unknown preset or model is refused now, not at a session's start

    @property
    def model(self) -> ModelConfig:
        return get_preset(self.preset)

    @property
    def timeline(self) -> Timeline:
        """The media timeline of the session's model (``preset``: a characters preset or a model family's
        name): every stage, the trace and egress read it, never a module constant."""
        from charstream.model.families import get_family

        return get_family(self.preset).timeline

    def apply_gil_switch_interval(self) -> None:
        """Set this process's GIL switch interval from ``gil_switch_interval_ms``: every process that runs
        a session's threads calls it (the serving process, each stage process). The value was checked
        when set: a NaN here aborted the interpreter (its GIL wait on a NaN deadline)."""
        sys.setswitchinterval(self.gil_switch_interval_ms / 1e3)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PipelineConfig:
        if isinstance(data, dict) and "placement" in data:
            raise ValueError("config key 'placement' is now 'hosting' (inproc, processes or engine)")
        return _build(cls, data, "")


def _fits(value: Any, hint: Any) -> bool:
    """``value`` is of the field type ``hint`` (an int is a float; a bool is no number; a tuple is a list)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        return any(_fits(value, a) for a in args)
    if origin is list:
        return isinstance(value, list | tuple) and all(_fits(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(_fits(k, args[0]) and _fits(v, args[1]) for k, v in value.items())
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is type(None):
        return value is None
    return isinstance(value, hint) if isinstance(hint, type) else True


def _build(kind: type, data: dict[str, Any], path: str):
    if not isinstance(data, dict):
        raise ValueError(f"config {path or '<root>'}: expected a table, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(kind)}
    hints = typing.get_type_hints(kind)
    unknown = set(data) - set(fields)
    if unknown:
        raise ValueError(f"config {path or '<root>'}: unknown key(s) {sorted(unknown)}; known: {sorted(fields)}")
    values = {}
    for name, value in data.items():
        default = fields[name].default_factory() if fields[name].default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(default):
            values[name] = _build(type(default), value, f"{path}{name}.")
        elif not _fits(value, hints[name]):
            hint = hints[name]
            raise ValueError(f"config {path}{name}: expected {hint.__name__ if isinstance(hint, type) else hint}, "
                             f"got {type(value).__name__} {str(value)[:40]!r}")
        else:
            values[name] = value
    return kind(**values)
