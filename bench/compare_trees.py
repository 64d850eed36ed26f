"""Per-op eager overhead of two source trees, measured side by side in one run.

Alternates ``bench/eager_overhead.py`` between the trees (each process imports torchneuron from
its tree's ``src`` through ``PYTHONPATH``), so load on a shared machine falls on both alike, and
prints each op's fastest neuron time per tree (the fastest repeat of any round: the one least
disturbed by other load) and their ratio:

    .venv/bin/python bench/compare_trees.py /path/to/old/checkout . [--rounds 5] [--calls 1000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent / "eager_overhead.py"


def run_once(tree: Path, calls: int, repeats: int) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(tree / "src"))
    out = subprocess.run([sys.executable, str(BENCH), "--calls", str(calls), "--repeats", str(repeats),
                          "--stat", "min"],
                         env=env, capture_output=True, text=True, check=True).stdout
    times = {}
    for line in out.splitlines():
        parts = line.rsplit(None, 5)
        if len(parts) == 6 and parts[4].endswith("x"):
            times[parts[0].strip()] = float(parts[1])
    if not times:
        raise RuntimeError(f"no timings in the output of {BENCH} for {tree}:\n{out}")
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("old", type=Path)
    parser.add_argument("new", type=Path)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    trees = {"old": args.old.resolve(), "new": args.new.resolve()}
    samples: dict[str, dict[str, list[float]]] = {k: {} for k in trees}
    for r in range(args.rounds):
        # Alternate which tree goes first, so a trend in the load favours neither.
        for label in (("old", "new") if r % 2 == 0 else ("new", "old")):
            for op, us in run_once(trees[label], args.calls, args.repeats).items():
                samples[label].setdefault(op, []).append(us)
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"old: {trees['old']}\nnew: {trees['new']}\n")
    print(f"{'op':22} {'old us':>8} {'new us':>8} {'new/old':>8}")
    ratios = []
    for op in samples["old"]:
        old = min(samples["old"][op])
        new = min(samples["new"][op])
        ratios.append(new / old)
        print(f"{op:22} {old:8.1f} {new:8.1f} {new / old:8.3f}")
    print(f"\nmedian new/old over ops: {statistics.median(ratios):.3f} ({args.rounds} rounds of each tree)")


if __name__ == "__main__":
    main()
