"""Migration-readiness report: ``torchneuron check -- python train.py`` or ``torchneuron.check()``.

collect.py gathers a run (steps, tracked values, call sites, costs), analyze.py turns runs into the
report's data and verdict, render.py writes Markdown / HTML / JSON, runner.py runs a user script in
the process the CLI starts, devmap.py maps ``cuda`` (or any device) onto another.
"""

from __future__ import annotations

from .api import check, load_run
from .collect import BudgetReached, Collector, step, track

__all__ = ["check", "step", "track", "load_run", "Collector", "BudgetReached"]
