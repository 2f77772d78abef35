"""The quality gate's percentile bootstrap (pipeline/quality/stats.py) against scipy.stats.bootstrap:
coverage of the 95% interval of a mean over repeated samples whose true mean is 0, its width, and
time per interval, for the gate's clip counts. scipy is not a charstream dependency:

    pip install scipy && python scripts/bootstrap_vs_scipy.py [--trials 300] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time
import warnings

import numpy as np
from scipy import stats

from charstream.pipeline.quality.stats import bootstrap_mean_ci


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=300)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    warnings.simplefilter("ignore")  # scipy's BCa warns on degenerate resamples
    rng = np.random.default_rng(7)

    def scipy_ci(v: np.ndarray, method: str) -> tuple[float, float]:
        ci = stats.bootstrap((v,), np.mean, n_resamples=10_000, method=method, vectorized=True,
                             random_state=int(rng.integers(1 << 30))).confidence_interval
        return ci.low, ci.high

    methods = {"charstream percentile": lambda v: bootstrap_mean_ci(v, seed=int(rng.integers(1 << 30))),
               "scipy percentile": lambda v: scipy_ci(v, "percentile"), "scipy BCa": lambda v: scipy_ci(v, "BCa")}
    samples = {"normal": lambda n: rng.normal(0.0, 0.01, n), "lognormal": lambda n: rng.lognormal(0, 1, n) - np.exp(0.5)}
    rows = []
    print("| clips | distribution | method | coverage (95% nominal) | median width | ms per interval |")
    print("|---|---|---|---|---|---|")
    for n in (6, 20):
        for dist, draw in samples.items():
            hits, widths, spent = dict.fromkeys(methods, 0), {m: [] for m in methods}, dict.fromkeys(methods, 0.0)
            for _ in range(args.trials):
                v = draw(n)
                for name, ci in methods.items():
                    t = time.perf_counter()
                    lo, hi = ci(v)
                    spent[name] += time.perf_counter() - t
                    hits[name] += lo <= 0.0 <= hi
                    widths[name].append(hi - lo)
            for name in methods:
                row = {"clips": n, "distribution": dist, "method": name, "coverage": hits[name] / args.trials,
                       "median_width": float(np.median(widths[name])), "ms": spent[name] / args.trials * 1000}
                rows.append(row)
                print(f"| {n} | {dist} | {name} | {row['coverage']:.3f} | {row['median_width']:.4f} | {row['ms']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
