"""Runs the user's script under a collector, in the process ``torchneuron check`` starts.

    python -m torchneuron.report.runner SPEC.json -- train.py ARGS...
    python -m torchneuron.report.runner SPEC.json -- -m package.module ARGS...

SPEC holds the role ("neuron" or "baseline"), device map, step budget, timeout and where to write
the run's data. The script runs as ``__main__`` with its own ``sys.argv``, exactly as ``python``
would run it; whatever happens to it (completion, exception, ``sys.exit``, budget), the run's data
is written.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import sys
import time
import traceback

from . import collect
from .devmap import DeviceMap
from .env import manifest
from .render import jsonable


def _parse_command(argv: list[str]):
    if not argv:
        raise SystemExit("torchneuron check: no script given after --")
    if argv[0] == "-m":
        if len(argv) < 2:
            raise SystemExit("torchneuron check: -m needs a module name")
        return "module", argv[1], argv[1:]
    if argv[0] == "-c":
        if len(argv) < 2:
            raise SystemExit("torchneuron check: -c needs a program string")
        return "code", argv[1], ["-c", *argv[2:]]
    return "path", argv[0], argv


def _run_user(kind: str, target: str, argv: list[str]) -> None:
    sys.argv = list(argv)
    if kind == "path":
        sys.path[0] = os.path.dirname(os.path.abspath(target))
        runpy.run_path(target, run_name="__main__")
    elif kind == "module":
        sys.path[0] = os.getcwd()
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.path[0] = ""
        exec(compile(target, "<string>", "exec"), {"__name__": "__main__"})


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 2 or argv[1] != "--":
        raise SystemExit("usage: python -m torchneuron.report.runner SPEC.json -- SCRIPT [ARGS...]")
    with open(argv[0]) as f:
        spec = json.load(f)
    kind, target, user_argv = _parse_command(argv[2:])

    import torchneuron  # noqa: F401  (registers the device before the script sees torch)

    devmap = DeviceMap(spec["device_map"]).install() if spec.get("device_map") else None
    collector = collect.Collector(role=spec["role"], max_steps=spec.get("steps"), sync=spec.get("sync", True),
                                  rtol=spec.get("rtol", 1e-3), atol=spec.get("atol", 1e-5),
                                  step_optimizer=spec.get("step_optimizer"))

    timeout = spec.get("timeout")
    previous_handler = None
    if timeout:
        def on_alarm(signum, frame):
            raise collect.BudgetReached("timeout")
        previous_handler = signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, float(timeout))

    status = {"outcome": "completed", "reason": None, "exit_code": 0, "error": None}
    start = time.perf_counter()
    collector.start()
    drift = None
    if spec.get("locate_drift") and spec["role"] == "neuron":
        drift = collect.DriftCapture(collector).install()
    try:
        _run_user(kind, target, user_argv)
    except collect.BudgetReached as stop:
        status.update(outcome="stopped", reason=stop.reason)
    except SystemExit as ex:
        code = ex.code
        if code not in (None, 0):
            status.update(outcome="error", exit_code=code if isinstance(code, int) else 1,
                          error={"type": "SystemExit", "message": str(code), "traceback": "", "site": None})
    except BaseException as err:  # noqa: B036 - the script's failure is the report's data
        status.update(outcome="error", exit_code=1, error=collect.describe_exception(err))
        traceback.print_exc()
    finally:
        if timeout:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous_handler)
    status["wall_seconds"] = time.perf_counter() - start
    data = collector.stop()
    if devmap is not None:
        data["device_map_rewrites"] = devmap.rewrites
        devmap.uninstall()
    data["status"] = status
    data["command"] = user_argv if kind != "module" else ["-m", *user_argv]
    data["device_map"] = spec.get("device_map") or {}
    data["environment"] = manifest()
    _write(data, spec["output"])
    if drift is not None:
        # After the run's data is written (a localisation that crashes loses only itself), and
        # after the collector stopped: its device work is not the script's.
        print("torchneuron check: locating drift (--locate-drift)", file=sys.stderr, flush=True)
        data["drift"] = drift.run(spec.get("rtol", 1e-3), spec.get("atol", 1e-5))
        _write(data, spec["output"])
    return 0


def _write(data: dict, path: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(jsonable(data), f, allow_nan=False)
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
