"""Hostile configuration values: every number of every section, refused where declared or harmless.

NaN in ``gil_switch_interval_ms`` aborted the interpreter; a negative offer timeout answered every
offer 403; a zero ping interval spun a core; a 1 ns memory trim interval held a core while idle.
"""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import sys

import pytest

from charstream.pipeline.bench.fuzz import config_keys, config_table, idle_cores
from charstream.pipeline.config import PipelineConfig
from charstream.pipeline.session import session_factory
from charstream.pipeline.web.client import EgressClient
from charstream.pipeline.web.server import EgressServer

HOSTILE = [float("nan"), float("inf"), float("-inf"), -1, 0, 1e-9, 1e300, 2**70, -(2**70)]

# What is accepted of HOSTILE, and why it is harmless: 0 (or next to nothing) where it is a real setting
# (no delay, no wait, the first seed, no minimum); a speech threshold just above 0 hears everything.
ACCEPTED = {
    "ingest.think_delay_s": [0, 1e-9], "ingest.vad_threshold": [1e-9], "ingest.playout_tail_s": [0, 1e-9],
    "ingest.lead_in_s": [0, 1e-9], "ingest.turn_gap_s": [0, 1e-9],
    "diffusion.seed": [0], "diffusion.batch_window_s": [0, 1e-9], "decode.batch_window_s": [0, 1e-9],
    "conditioning.batch_window_s": [0, 1e-9],
    "playout.target_depth_chunks": [0], "playout.initial_allowance_s": [0, 1e-9],
    "egress.port": [0], "egress.memory_trim_s": [0],  # a free port; never trimmed
    "tracing.prometheus_port": [0],
    "transport.slot_bytes": [0], "transport.slot_min_bytes": [0],  # slots off; every array slotted
    "fleet.retry_after_s": [0], "fleet.slow_fps": [0, 1e-9], "fleet.health_min_seconds": [0, 1e-9],
    "fleet.node_loss_grace_s": [0, 1e-9],
}


def build(section: str, name: str, value) -> PipelineConfig:
    data: dict = {}
    config_table(data, section)[name] = {"edge": value} if name == "capacities" else value
    return PipelineConfig.from_dict(data)


def test_every_number_of_every_section_refuses_hostile_values_naming_the_key():
    keys = config_keys()
    assert len(keys) > 50 and ("egress", "ping_interval_s") in keys and ("", "gil_switch_interval_ms") in keys
    assert ("diffusion.step", "window_splits") in keys
    accepted = {}
    for section, name in keys:
        key = f"{section}.{name}" if section else name
        for value in HOSTILE:
            try:
                build(section, name, value)
            except ValueError as e:
                assert key in str(e) and "\n" not in str(e), (key, value, str(e))
            else:
                accepted.setdefault(key, []).append(value)
    assert accepted == ACCEPTED


@pytest.mark.parametrize("data, said", [
    ({"egress": {"client_timeout_s": 1.0, "ping_interval_s": 1.0}}, "egress.client_timeout_s: 1 must exceed"),
    ({"playout": {"target_depth_chunks": 8}}, "playout.max_depth_chunks: 8 must exceed playout.target_depth_chunks"),
    ({"transport": {"heartbeat_s": 2.0}}, "transport.dead_after_s: 1.5 must exceed transport.heartbeat_s"),
    ({"egress": {"max_sessions": 1.5}}, "config egress.max_sessions: expected int"),
])
def test_fields_that_only_break_together_are_refused(data, said):
    with pytest.raises(ValueError, match=said):
        PipelineConfig.from_dict(data)


def test_code_that_sets_a_hostile_value_is_refused_as_a_file_is():
    config = PipelineConfig()
    for section, name, value in [("egress", "ping_interval_s", 0), ("egress", "memory_trim_s", 1e-9),
                                 ("playout", "history_frames", -1), ("transport", "max_message_bytes", -1)]:
        with pytest.raises(ValueError, match=f"{section}.{name}: "):
            setattr(getattr(config, section), name, value)
    with pytest.raises(ValueError, match="egress.reservations_per_client: -1 is not"):
        dataclasses.replace(config.egress, reservations_per_client=-1)
    assert config == PipelineConfig()  # nothing refused was kept


def test_a_nan_in_the_config_file_is_refused_before_serving(tmp_path):
    """``gil_switch_interval_ms = nan`` aborted ``serve`` (SIGABRT in the GIL's wait)."""
    config = tmp_path / "nan.toml"
    config.write_text("gil_switch_interval_ms = nan\n")
    done = subprocess.run([sys.executable, "-m", "charstream", "serve", "--config", str(config), "--port", "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, (done.returncode, done.stderr[-500:])
    assert done.stdout.strip() == "charstream serve: gil_switch_interval_ms: nan is not a finite number"


def test_the_accepted_values_together_still_serve_a_session_and_leave_the_server_idle():
    """What the walk above accepts for the serving sections, all at once: a session streams, and the
    idle server then uses under a tenth of a core (a 1 ns trim interval once held a whole one)."""
    data: dict = {}
    for key, values in ACCEPTED.items():
        section, _, name = key.rpartition(".")
        if section in ("egress", "playout", "transport", ""):
            data.setdefault(section, {})[name] = values[-1]
    config = PipelineConfig.from_dict(data)

    async def main():
        server = EgressServer(config.egress, session_factory(config, testcard=True))
        url = await server.start()
        _, token = server.create_session()
        client = EgressClient()
        await client.connect(url, token)
        await client.wait_for_video(24, timeout=30)
        await client.close()
        idle_cpu = await idle_cores(3.0)
        await server.stop()
        return idle_cpu

    assert asyncio.run(main()) < 0.1
