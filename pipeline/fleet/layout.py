"""A session layout as Ray placement-group bundles: one per diffusion TP rank, one for the decoder.

GPU layouts reserve ``GPU``; the CPU layout reserves the custom resource a CPU node advertises
(``FleetConfig.cpu_device_resource``), so a fleet of CPU nodes is placed exactly like GPU hosts.
"""

from __future__ import annotations

import math
from collections import Counter

from charstream.pipeline.fleet.config import FleetConfig
from charstream.pipeline.runtime.layouts import LAYOUTS, Layout


def session_layout(config: FleetConfig) -> Layout:
    try:
        return LAYOUTS[config.layout]
    except KeyError:
        raise ValueError(f"unknown fleet layout {config.layout!r}; known: {', '.join(LAYOUTS)}") from None


def session_bundles(config: FleetConfig) -> list[dict[str, float]]:
    layout = session_layout(config)
    device = "GPU" if layout.gpus else config.cpu_device_resource
    bundles = [{device: 1.0} for _ in layout.diffusion]
    # Layout "3" decodes on the last rank's GPU: its decoder bundle holds a CPU, not a second GPU.
    shares_gpu = layout.gpus > 0 and layout.decoder in layout.diffusion
    bundles.append({"CPU": 1.0} if shares_gpu else {device: 1.0})
    return bundles


def session_demand(config: FleetConfig) -> dict[str, float]:
    """What one session takes from its node, summed over its bundles."""
    total: Counter[str] = Counter()
    for bundle in session_bundles(config):
        total.update(bundle)
    return dict(total)


def layouts_that_fit(free: dict[str, float], demand: dict[str, float]) -> int:
    return min(math.floor(free.get(name, 0.0) / amount + 1e-9) for name, amount in demand.items())
