"""The ``torchneuron`` command.

    torchneuron check [options] -- python train.py ARGS...     migration-readiness report
    torchneuron env [--json]                                   version manifest of this machine
    torchneuron doctor [--json] [--timeout S] [--cache-dir DIR] preflight: platform, rank device, collective, cache
    torchneuron cache info [--cache-dir DIR]                   what the compile cache holds
    torchneuron cache pack ARCHIVE [--cache-dir DIR]           the compile cache as one tar.gz
    torchneuron cache unpack ARCHIVE [--cache-dir DIR]         merge an archive into the compile cache
    torchneuron cache verify [--cache-dir DIR] -- python app.py ARGS...
                                                               list what a run compiles despite the cache

``check`` runs the unmodified script in a child process under a collector (and, when asked, again
on CPU as a numerical and performance baseline, and again as a warm start), then writes
report.md, report.html and report.json. Exit status: 0 ready, 1 problems at or above --fail-on,
2 the command could not be run (invalid options, checked before anything runs; an unwritable report
folder; a failed --preflight), 128+N stopped by signal N (the script is stopped with it).

``cache verify`` exits 0 when the cache served every executable the run needed, 1 when some had
to be compiled (each is listed with why), 2 when it could not verify (no cache, the script failed).

``doctor`` checks, before any model code, what a long run finds out late (report/doctor.py); exit
status 0 when every check is ok or a warning, 1 when one failed. ``check --preflight`` runs it first.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading

from . import cache_tools
from .report import analyze, render
from .report.api import load_run
from .report.devmap import compose, parse
from .report.env import manifest

_PY_FLAGS_WITH_VALUE = ("-X", "-W", "-Q")

# Exit statuses of `torchneuron check`.
READY, BLOCKERS, UNUSABLE = 0, 1, 2


class UsageError(Exception):
    """The command cannot be run as given (reported before anything runs; exit status 2)."""


class Terminated(BaseException):
    """SIGTERM/SIGHUP reached the CLI: the checked script is stopped too (exit status 128+signal)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _terminate(signum, frame):
    raise Terminated(signum)


def _split_command(command: list[str], prog: str = "torchneuron check") -> tuple[list[str], list[str]]:
    """["python", "-u", "train.py", "--lr", "1"] -> (["python", "-u"], ["train.py", "--lr", "1"])."""
    if not command:
        raise UsageError("give the command after --, e.g. -- python train.py")
    first = command[0]
    if first.endswith(".py"):
        return [sys.executable], command
    if not os.path.basename(first).startswith("python"):
        raise UsageError(f"{prog} runs Python programs; got {first!r}. "
                         f"Use: {prog} -- python train.py ARGS")
    exe = shutil.which(first) or first
    interp, rest = [exe], command[1:]
    while rest and rest[0].startswith("-") and rest[0] not in ("-m", "-c"):
        flag = rest.pop(0)
        interp.append(flag)
        if flag in _PY_FLAGS_WITH_VALUE and rest:
            interp.append(rest.pop(0))
    if not rest:
        raise UsageError("no script or -m module in the command")
    return interp, rest


def _parse_tolerances(specs) -> dict:
    out = {}
    for spec in specs or ():
        name, sep, value = spec.partition("=")
        if not sep:
            raise UsageError(f"--tol expects NAME=RTOL[,ATOL], got {spec!r}")
        parts = value.split(",")
        try:
            rtol = float(parts[0])
            atol = float(parts[1]) if len(parts) > 1 else 0.0
        except ValueError:
            raise UsageError(f"--tol expects numbers, got {spec!r}") from None
        if not (rtol >= 0 and atol >= 0):
            raise UsageError(f"--tol expects tolerances >= 0, got {spec!r}")
        out[name] = (rtol, atol)
    return out


def _tee(stream, sinks):
    for line in iter(stream.readline, b""):
        for sink in sinks:
            sink.write(line)
            sink.flush()
    stream.close()


def _run_child(label, interp, script_argv, spec, folder, args, env) -> dict:
    """One run of the script; returns its data (or a stand-in if it produced none)."""
    spec_path = os.path.join(folder, f"spec-{label}.json")
    out_path = os.path.join(folder, f"run-{label}.json")
    spec["output"] = out_path
    if os.path.exists(out_path):
        os.remove(out_path)
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    cmd = [*interp, "-m", "torchneuron.report.runner", spec_path, "--", *script_argv]
    log_path = os.path.join(folder, f"{label}.log")
    print(f"torchneuron check: {label} run: {' '.join(script_argv)}", file=sys.stderr, flush=True)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        sinks = [log] if args.quiet else [log, sys.stdout.buffer]
        reader = threading.Thread(target=_tee, args=(proc.stdout, sinks), daemon=True)
        reader.start()
        limit = None
        if args.timeout:
            # The script stops itself at --timeout; this is the hard stop if it cannot.
            limit = args.timeout + max(30.0, 0.25 * args.timeout)
        timed_out = False
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc = proc.wait()
            timed_out = True
        except BaseException:   # Ctrl-C, or SIGTERM/SIGHUP (Terminated): no orphaned script
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        reader.join(timeout=10)
    if os.path.exists(out_path):
        with open(out_path) as f:
            return json.load(f)
    why = (f"killed by signal {-rc}" if rc < 0 else f"exited with status {rc}") + \
        f" before writing its data; see {log_path}"
    if timed_out:
        why = f"did not stop within {limit:.0f} s of its {args.timeout:g} s time budget and was killed"
    run = analyze.empty_run(spec["role"], f"The {label} run {why}.", script_argv, spec.get("device_map"))
    run["status"]["reason"] = "timeout" if timed_out else None
    return run


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="torchneuron check",
        usage="torchneuron check [options] -- python train.py ARGS...",
        description="Run an unmodified PyTorch script on neuron and write a migration-readiness report "
                    "(report.md, report.html, report.json).")
    p.add_argument("-o", "--output", default="torchneuron-report", help="report folder (default: %(default)s)")
    p.add_argument("--baseline", metavar="cpu|PATH",
                   help="'cpu': run the script again on CPU and compare; or a report.json / run JSON of an "
                        "earlier run")
    p.add_argument("--steps", type=int, help="stop the script after this many steps")
    p.add_argument("--timeout", type=float, help="stop the script after this many seconds (per run)")
    p.add_argument("--warmup", type=int, default=1, help="steps excluded from steady state (default: 1)")
    p.add_argument("--device-map", action="append", default=[], metavar="SRC=DST",
                   help="run a script written for SRC on DST, e.g. cuda=neuron (repeatable)")
    p.add_argument("--rtol", type=float, default=1e-3, help="default relative tolerance of tracked values")
    p.add_argument("--atol", type=float, default=1e-5, help="default absolute tolerance of tracked values")
    p.add_argument("--tol", action="append", default=[], metavar="NAME=RTOL[,ATOL]",
                   help="tolerance of one tracked value (repeatable)")
    p.add_argument("--warm-start", action="store_true",
                   help="run a second time in a fresh process with the compile cache of the first "
                        "(cold vs warm start)")
    p.add_argument("--no-sync", action="store_true",
                   help="do not wait for device work at step marks (latencies then measure dispatch only)")
    p.add_argument("--locate-drift", action="store_true",
                   help="after the script ends, find the first module and ATen op of its model (the first "
                        "module called with all parameters on neuron, on the inputs of that first call) "
                        "whose neuron result leaves CPU's tolerance (--rtol/--atol)")
    p.add_argument("--verify-fusion", action="store_true",
                   help="run the script in adaptive eager mode (unless TORCHNEURON_EAGER_MODE is set) and "
                        "compare each fused region with its ops run one by one; a fused group that differs, "
                        "fails to compile or fails to run is bisected to the smallest failing group, which runs "
                        "op by op and is named in the report")
    p.add_argument("--title", help="report title")
    p.add_argument("--fail-on", choices=("blocker", "warning", "never"), default="blocker",
                   help="exit with status 1 when the report has problems of this severity (default: blocker)")
    p.add_argument("-q", "--quiet", action="store_true", help="do not echo the script's output (logs are kept)")
    p.add_argument("--preflight", action="store_true",
                   help="run `torchneuron doctor` with the script's interpreter and environment first; stop "
                        "(exit status 2) when a check fails")
    return p


def _validate(args) -> None:
    """Every option checked before the script runs (a run can take hours)."""
    import math
    if args.timeout is not None and not (math.isfinite(args.timeout) and args.timeout > 0):
        raise UsageError(f"--timeout must be a positive number of seconds, got {args.timeout:g}")
    if args.steps is not None and args.steps < 1:
        raise UsageError(f"--steps must be at least 1, got {args.steps}")
    if args.warmup < 0:
        raise UsageError(f"--warmup must be 0 or more, got {args.warmup}")
    for name in ("rtol", "atol"):
        value = getattr(args, name)
        if not (value >= 0 and math.isfinite(value)):
            raise UsageError(f"--{name} must be a finite number >= 0, got {value:g}")


def _report_folder(path: str) -> str:
    """The report folder, created and proven writable now rather than after the run."""
    folder = os.path.abspath(path)
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        raise UsageError(f"cannot write the report folder {folder} ({err.strerror or err}); "
                         "choose another with -o/--output") from None
    return folder


def check(argv: list[str]) -> int:
    # A SIGTERM/SIGHUP (CI timeouts, timeout(1), a closed terminal) stops the script with the CLI
    # instead of orphaning it (it runs in its own session so that it can be killed as a group).
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, _terminate) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        return _check(argv)
    except UsageError as err:
        print(f"torchneuron check: error: {err}", file=sys.stderr)
        return UNUSABLE
    except Terminated as stop:
        print(f"torchneuron check: stopped by signal {stop.signum}; the script was stopped too.",
              file=sys.stderr)
        return 128 + stop.signum
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _check(argv: list[str]) -> int:
    if "--" in argv:
        split = argv.index("--")
        opts, command = argv[:split], argv[split + 1:]
    else:
        opts, command = argv, []
    p = _parser()
    args = p.parse_args(opts)
    if not command:
        p.error("give the command to run after --, e.g. torchneuron check -- python train.py")

    _validate(args)
    tolerances = _parse_tolerances(args.tol)
    try:
        device_map = parse(args.device_map)
    except ValueError as err:
        raise UsageError(str(err)) from None
    interp, script_argv = _split_command(command)
    baseline = label = None
    if args.baseline and args.baseline != "cpu":
        try:
            baseline, label = load_run(args.baseline)
        except (OSError, ValueError, KeyError) as err:
            raise UsageError(f"--baseline {args.baseline}: {getattr(err, 'strerror', None) or err}") from None
    folder = _report_folder(args.output)
    env = dict(os.environ)
    # The child imports this very torchneuron, whatever the interpreter's own path says.
    pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if args.verify_fusion:
        env["TORCHNEURON_ADAPTIVE_VERIFY_FUSION"] = "1"
        env.setdefault("TORCHNEURON_EAGER_MODE", "adaptive")
    if args.preflight:
        _preflight(interp, env)
    spec = {"role": "neuron", "device_map": device_map, "steps": args.steps, "timeout": args.timeout,
            "sync": not args.no_sync, "rtol": args.rtol, "atol": args.atol}
    cache_dir = None
    if args.warm_start:
        # Cold must be cold: both runs share a compile cache that starts empty.
        cache_dir = tempfile.mkdtemp(prefix="compile-cache-", dir=folder)
        env["TORCHNEURON_CACHE_DIR"] = cache_dir
    try:
        run = _run_child("neuron", interp, script_argv, dict(spec, locate_drift=args.locate_drift), folder,
                         args, env)
        warm = None
        if args.warm_start:
            warm = _run_child("warm", interp, script_argv, dict(spec), folder, args, env)
        if args.baseline == "cpu":
            bspec = dict(spec, role="baseline", device_map=compose(device_map, {"neuron": "cpu"}))
            if run.get("step_source") == "optimizer":
                # On CPU every optimizer's parameters are on CPU: count the one the neuron run counted.
                bspec["step_optimizer"] = run.get("step_optimizer")
            baseline = _run_child("baseline", interp, script_argv, bspec, folder, args, env)
            label = "CPU run of the same script"
    finally:
        if cache_dir:
            shutil.rmtree(cache_dir, ignore_errors=True)
    options = {k: v for k, v in vars(args).items() if k not in ("quiet",)}
    report = analyze.build(run, baseline=baseline, warm=warm, warmup=args.warmup,
                           tolerances=tolerances, title=args.title, baseline_label=label,
                           options=options)
    report["command"] = [os.path.basename(interp[0]), *interp[1:], *script_argv]
    try:
        files = render.write(report, folder)
    except OSError as err:
        print(f"torchneuron check: error: the run finished but its report could not be written to "
              f"{folder} ({err.strerror or err})", file=sys.stderr)
        return UNUSABLE
    v = report["verdict"]
    print(f"\ntorchneuron check: {v['summary']}", file=sys.stderr)
    for f in report["findings"]:
        print(f"  [{f['severity']}] {f['title']}: {f['detail']}", file=sys.stderr)
    print("report: " + ", ".join(files.values()), file=sys.stderr)
    if args.fail_on == "never":
        return READY
    if v["blockers"] or (args.fail_on == "warning" and v["warnings"]):
        return BLOCKERS
    return READY


def _preflight(interp, env) -> None:
    """`torchneuron doctor` in the interpreter and environment the script gets, before any run."""
    print("torchneuron check: preflight: torchneuron doctor", file=sys.stderr, flush=True)
    rc = subprocess.run([*interp, "-m", "torchneuron", "doctor"], env=env).returncode
    if rc != 0:
        raise UsageError(f"the preflight failed (torchneuron doctor exited with status {rc}, its table is above); "
                         "nothing was run")


def doctor_command(argv: list[str]) -> int:
    from .report import doctor  # loaded only for this command (it imports the runtime)
    p = argparse.ArgumentParser(prog="torchneuron doctor",
                                description="Preflight: versions, platform, the device of this torchrun rank, a "
                                            "collective across ranks, the cache folder, fork safety, settings.")
    p.add_argument("--json", action="store_true", help="print the checks as JSON")
    p.add_argument("--timeout", type=float, default=30.0,
                   help="seconds the collective may wait for the other ranks (default: %(default)s)")
    p.add_argument("--cache-dir", help="the cache folder to check (default: config.cache_dir, TORCHNEURON_CACHE_DIR)")
    args = p.parse_args(argv)
    if not (0 < args.timeout < float("inf")):
        p.error(f"--timeout must be a positive number of seconds, got {args.timeout:g}")
    results = doctor.run_checks(cache_dir=args.cache_dir, timeout=args.timeout)
    status = doctor.exit_status(results)
    if args.json:
        print(json.dumps({"ok": status == 0, "checks": results}, indent=1, default=str))
    else:
        print(doctor.table(results))
    return status


def env_command(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="torchneuron env", description="Print the version manifest.")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    info = manifest()
    if args.json:
        print(json.dumps(info, indent=1))
    else:
        for k, v in info.items():
            if isinstance(v, dict):
                v = ", ".join(f"{a}={b}" for a, b in v.items()) or "–"
            print(f"{k:22} {v}")
    return 0


def cache_command(argv: list[str]) -> int:
    opts, command = argv, None
    if "--" in argv:
        split = argv.index("--")
        opts, command = argv[:split], argv[split + 1:]
    p = argparse.ArgumentParser(prog="torchneuron cache",
                                description="Inspect, ship and check the persistent compile cache.")
    sub = p.add_subparsers(dest="action", required=True, metavar="info|pack|unpack|verify")
    help_dir = "the cache folder (default: config.cache_dir, TORCHNEURON_CACHE_DIR)"
    sub.add_parser("info", help="entries per kind, bytes and fingerprints").add_argument("--cache-dir", help=help_dir)
    for action, what in (("pack", "write the cache folder and a manifest to ARCHIVE (tar.gz)"),
                         ("unpack", "merge ARCHIVE into the cache folder")):
        sp = sub.add_parser(action, help=what)
        sp.add_argument("archive", metavar="ARCHIVE")
        sp.add_argument("--cache-dir", help=help_dir)
    sp = sub.add_parser("verify", usage="torchneuron cache verify [--cache-dir DIR] -- python app.py ARGS...",
                        help="run a script on a copy of the cache and list what it compiled anyway")
    sp.add_argument("--cache-dir", help=help_dir)
    args = p.parse_args(opts)
    prog = f"torchneuron cache {args.action}"
    try:
        directory = cache_tools.cache_dir(args.cache_dir)
        if args.action == "info":
            return cache_tools.info(directory)
        if args.action == "pack":
            return cache_tools.pack(args.archive, directory)
        if args.action == "unpack":
            return cache_tools.unpack(args.archive, directory)
        if not command:
            raise UsageError("give the command to run after --, e.g. torchneuron cache verify -- python app.py")
        interp, script_argv = _split_command(command, prog)
        return cache_tools.verify(directory, interp, script_argv)
    except (UsageError, cache_tools.CacheToolError) as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return UNUSABLE


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = __doc__.strip().split("\n\n")[1]
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        return 0 if argv else 2
    command = {"check": check, "env": env_command, "cache": cache_command, "doctor": doctor_command}.get(argv[0])
    if command is None:
        print(f"torchneuron: unknown command {argv[0]!r}\n\n{usage}", file=sys.stderr)
        return 2
    return command(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
