"""Per-op eager overhead of two source trees, measured side by side in one run.

Alternates ``bench/eager_overhead.py`` between the trees (each process imports torchneuron from
its tree's ``src`` through ``PYTHONPATH``), so load on a shared machine falls on both alike, and
prints each op's fastest neuron time per tree, wall and CPU time (the fastest repeat of any
round: the one least disturbed by other load) and their ratios:

    .venv/bin/python bench/compare_trees.py /path/to/old/checkout . [--rounds 5] [--calls 1000]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent / "eager_overhead.py"


# One op's row of eager_overhead.py: its name (may hold spaces), then neuron/cpu/jax wall times,
# the neuron/cpu ratio, the wall overhead, then the CPU-time columns (neuron, jax, overhead).
_ROW = re.compile(r"^(?P<op>.*?)\s+(?P<wall>[\d.]+)\s+[\d.]+\s+[\d.]+\s+[\d.]+x\s+[\d.]+"
                  r"\s+(?P<cpu>[\d.]+)\s+[\d.]+\s+[\d.]+\s*$")


def run_once(tree: Path, calls: int, repeats: int) -> dict[str, tuple[float, float]]:
    """op -> (neuron wall us, neuron CPU-time us) of one run of the benchmark on ``tree``."""
    env = dict(os.environ, PYTHONPATH=str(tree / "src"))
    out = subprocess.run([sys.executable, str(BENCH), "--calls", str(calls), "--repeats", str(repeats),
                          "--stat", "min"],
                         env=env, capture_output=True, text=True, check=True).stdout
    times = {}
    for line in out.splitlines():
        m = _ROW.match(line)
        if m:
            times[m["op"].strip()] = (float(m["wall"]), float(m["cpu"]))
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
    print(f"{'op':26} {'old us':>8} {'new us':>8} {'new/old':>8}   {'old CPU us':>10} {'new CPU us':>10} {'new/old':>8}")
    wall_ratios, cpu_ratios = [], []
    for op in samples["old"]:
        old_wall, old_cpu = (min(t[i] for t in samples["old"][op]) for i in (0, 1))
        new_wall, new_cpu = (min(t[i] for t in samples["new"][op]) for i in (0, 1))
        wall_ratios.append(new_wall / old_wall)
        cpu_ratios.append(new_cpu / old_cpu)
        print(f"{op:26} {old_wall:8.1f} {new_wall:8.1f} {new_wall / old_wall:8.3f}   "
              f"{old_cpu:10.1f} {new_cpu:10.1f} {new_cpu / old_cpu:8.3f}")
    print(f"\nmedian new/old over ops: wall {statistics.median(wall_ratios):.3f}, CPU time "
          f"{statistics.median(cpu_ratios):.3f} ({args.rounds} rounds of each tree)")

if __name__ == "__main__":
    main()
