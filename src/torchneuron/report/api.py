"""``torchneuron.check()``: the readiness report from inside a program.

    with torchneuron.check("readiness/") as chk:
        for batch in loader:
            ...
            torchneuron.track("loss", loss)
            torchneuron.step()
    print(chk.verdict["summary"])

Collects exactly what ``torchneuron check -- python script.py`` collects (minus the separate
baseline process: pass ``baseline=`` a report.json or run JSON from an earlier run to compare).
"""

from __future__ import annotations

import json
import sys

from . import analyze, collect, render
from .env import manifest


def load_run(path: str) -> tuple[dict, str]:
    """A run to compare against: a report.json (its neuron run) or a run-*.json."""
    with open(path) as f:
        data = json.load(f)
    schema = data.get("schema", "")
    if schema.startswith("torchneuron.report/"):
        return data["runs"]["neuron"], f"{path} ({data.get('created', 'unknown date')})"
    if schema.startswith("torchneuron.run/"):
        return data, f"{path} ({data.get('started', 'unknown date')})"
    raise ValueError(f"torchneuron: {path} is neither a torchneuron report nor a run (schema {schema!r})")


class check:  # noqa: N801 - used as a function-like context manager, like torch.no_grad
    """Collect a migration-readiness report for the code inside the ``with`` block.

    output: folder for report.md / report.html / report.json (None: keep it in memory only).
    baseline: path of an earlier report.json or run JSON whose tracked values and step times this
    run is compared with. warmup: steps excluded from steady-state statistics. rtol/atol: default
    tolerances for tracked values; tolerances: {name: (rtol, atol)} overrides.
    """

    def __init__(self, output: str | None = None, *, baseline: str | None = None, warmup: int = 1,
                 rtol: float = analyze.DEFAULT_RTOL, atol: float = analyze.DEFAULT_ATOL,
                 tolerances: dict | None = None, title: str | None = None, sync: bool = True):
        self.output = output
        self.baseline = baseline
        self.warmup = warmup
        self.tolerances = dict(tolerances or {})
        self.title = title
        self.collector = collect.Collector(role="neuron", sync=sync, rtol=rtol, atol=atol)
        self.report: dict | None = None
        self.files: dict[str, str] = {}

    def start(self) -> check:
        self.collector.start()
        return self

    def stop(self, error: BaseException | None = None) -> dict:
        data = self.collector.stop()
        status = {"outcome": "completed", "reason": None, "exit_code": 0, "error": None}
        if error is not None:
            status.update(outcome="error", exit_code=1, error=collect.describe_exception(error))
        data["status"] = status
        data["command"] = [sys.executable, *sys.argv]
        data["device_map"] = {}
        data["environment"] = manifest()
        run = json.loads(render.to_json(data))   # the same data a CLI run writes
        base, label = load_run(self.baseline) if self.baseline else (None, None)
        self.report = analyze.build(run, baseline=base, warmup=self.warmup, tolerances=self.tolerances,
                                    title=self.title, baseline_label=label,
                                    options={"warmup": self.warmup, "baseline": self.baseline})
        if self.output:
            self.files = render.write(self.report, self.output)
        return self.report

    def __enter__(self) -> check:
        return self.start()

    def __exit__(self, exc_type, exc, tb):
        self.stop(exc if exc_type is not None and not issubclass(exc_type, collect.BudgetReached) else None)
        return False

    @property
    def findings(self) -> list[dict]:
        return self.report["findings"] if self.report else []

    @property
    def verdict(self) -> dict | None:
        return self.report["verdict"] if self.report else None
