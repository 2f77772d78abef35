"""Loss history of a training run: appended per step, saved as JSON and drawn as PNG curves."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import numpy as np


class LossLog:
    def __init__(self) -> None:
        self.series: dict[str, list[tuple[int, float]]] = defaultdict(list)

    def add(self, name: str, step: int, value: float) -> None:
        self.series[name].append((step, float(value)))

    def save(self, out_dir: Path, stem: str = "loss") -> list[Path]:
        """``<stem>.json`` plus one ``<stem>_<series>.png`` per series (raw + moving average, log y)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"{stem}.json").write_text(json.dumps(self.series))
        paths = []
        for name, points in self.series.items():
            if not points:
                continue
            steps, values = np.array(points).T
            fig, ax = plt.subplots(figsize=(6, 3.5))
            ax.plot(steps, values, lw=0.6, alpha=0.4, label="per step")
            k = max(1, len(values) // 50)
            if k > 1:
                smooth = np.convolve(values, np.ones(k) / k, mode="valid")
                ax.plot(steps[k - 1:], smooth, lw=1.5, label=f"mean of {k}")
            ax.set_xlabel("step")
            ax.set_ylabel(name)
            if values.min() > 0:
                ax.set_yscale("log")
            ax.set_title(f"{stem}: {name}")
            ax.legend()
            fig.tight_layout()
            path = out_dir / f"{stem}_{name}.png"
            fig.savefig(path, dpi=100)
            plt.close(fig)
            paths.append(path)
        return paths
