"""The fleet's arithmetic without a cluster: bundles per layout, which node a session goes to, health."""

from __future__ import annotations

import pytest

from charstream.pipeline.config import PipelineConfig
from charstream.pipeline.fleet.commands import format_status
from charstream.pipeline.fleet.config import FleetConfig
from charstream.pipeline.fleet.frontdoor import FrontDoor, Full, NodeState
from charstream.pipeline.fleet.health import FleetHealth
from charstream.pipeline.fleet.layout import layouts_that_fit, session_bundles, session_demand


def test_a_layout_is_one_bundle_per_rank_and_one_for_the_decoder():
    assert session_bundles(FleetConfig(layout="3+1")) == [{"GPU": 1.0}] * 4
    # Layout 3 decodes on the last rank's GPU: three GPUs, the decoder's bundle a CPU.
    assert session_bundles(FleetConfig(layout="3")) == [{"GPU": 1.0}] * 3 + [{"CPU": 1.0}]
    assert session_bundles(FleetConfig(layout="cpu")) == [{"charstream_cpu": 1.0}] * 2
    assert session_demand(FleetConfig(layout="6+1")) == {"GPU": 7.0}
    assert layouts_that_fit({"GPU": 8.0, "CPU": 1.0}, session_demand(FleetConfig(layout="3+1"))) == 2
    assert layouts_that_fit({"GPU": 8.0}, session_demand(FleetConfig(layout="3"))) == 0  # no CPU for its decoder
    with pytest.raises(ValueError, match="unknown fleet layout"):
        session_bundles(FleetConfig(layout="5+1"))


def door_with(nodes: dict[str, float], cap: int = 2) -> FrontDoor:
    door = FrontDoor(PipelineConfig(fleet=FleetConfig(layout="3+1", max_sessions_per_node=cap)), "testcard")
    door.nodes = {name: NodeState(name, {"GPU": gpus, "CPU": 16.0}) for name, gpus in nodes.items()}
    return door


def test_sessions_go_to_the_node_with_most_free_layouts_under_its_cap():
    door = door_with({"a": 8, "b": 4, "c": 4}, cap=2)
    placed = []
    for i in range(4):
        node = door.pick_node()
        node.sessions.add(f"s{i}")
        placed.append(node.node_id)
    assert placed[0] == "a" and sorted(placed) == ["a", "a", "b", "c"]
    assert [door.free_layouts(n) for n in door.nodes.values()] == [0, 0, 0]
    with pytest.raises(Full):
        door.pick_node()
    door.nodes["a"].sessions.discard("s0")
    assert door.pick_node().node_id == "a"


def test_a_draining_or_dead_node_takes_no_session():
    door = door_with({"a": 8, "b": 4})
    door.drain("a")
    assert door.pick_node().node_id == "b"
    door.nodes["b"].alive = False
    with pytest.raises(Full):
        door.pick_node()
    with pytest.raises(ValueError, match="0 nodes match"):
        door.drain("z")


def test_fleet_health_counts_sessions_that_played_long_enough():
    health = FleetHealth(FleetConfig(slow_fps=23.0, health_min_seconds=5.0))
    health.record_ended(60.0, 23.9)
    health.record_ended(60.0, 18.0)
    health.record_ended(2.0, 3.0)  # too short to count
    figures = health.figures([(30.0, 23.0), (1.0, 0.0), (30.0, None)])
    assert (figures.measured, figures.slow, figures.slow_share) == (3, 2, 2 / 3)


def test_status_prints_nodes_sessions_and_health():
    door = door_with({"a" * 20: 8, "b" * 20: 4})
    door.nodes["b" * 20].alive = False
    text = format_status(door.status())
    assert "aaaaaaaaaaaa  alive" in text and "bbbbbbbbbbbb  dead" in text
    assert "health: 0 of 0 measured sessions averaging <= 23.0 fps (-)" in text
