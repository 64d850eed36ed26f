"""ATen coverage of the neuron device: ``python -m tools.coverage``.

Two measurements go into ``docs/coverage.md``:

1. **Core ATen IR**, statically: for every overload tagged ``core``, whether neuron runs it
   natively (a lowering, a host kernel, or a backend-independent metadata kernel), through a
   PyTorch decomposition into lowered ops, or on the CPU fallback.
2. **The OpInfo sweep**: PyTorch's OpInfo database run on neuron against CPU by the harness in
   ``tests/opinfo`` (the same code ``pytest -m slow tests/opinfo`` runs). Per entry: native /
   decomposed / CPU fallback / failing, and totals against the targets.

The sweep appends one JSON line per sample to ``--results`` (default
``build/coverage/results.jsonl``) so it can be resumed (``--resume``), split over worker processes
(``--jobs``; a worker that crashes is replaced and the entry it was on recorded as failing), or
re-rendered without running anything (``--render-only``); see ``tools/sweep.py``.

``--shapes bucketed`` runs the sweep at padded sizes instead: every sample compiled with
``torch.compile(backend="neuron")`` and ``config.shapes = "bucketed"``, its dims of size >= 2 marked
dynamic (``tests/opinfo/bucketed.py``), with results in ``build/coverage/bucketed.jsonl``; it writes
only the report's last section, "Bucketed shapes" (a static sweep keeps that section as it is).

The sweep runs the OpInfo harness of this checkout (``tests/opinfo``, with the test extras:
``pip install -e ".[test]"``; ``--tests-dir`` points at another checkout's ``tests`` directory).
Run it from the repository root: ``python -m tools.coverage``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

import jax
import torch
from torch._decomp import decomposition_table

import torchneuron
from torchneuron.ops import registry
from torchneuron.ops.signature import registry_name

from . import sweep as resumable

DEFAULT_RESULTS = resumable.default_path("build/coverage/results.jsonl")
DEFAULT_BUCKETED_RESULTS = resumable.default_path("build/coverage/bucketed.jsonl")
DEFAULT_OUTPUT = resumable.default_path("docs/coverage.md")
DEFAULT_TESTS = resumable.default_path("tests")
STATUSES = ("native", "fallback", "expected", "fail")


# -- the OpInfo sweep -------------------------------------------------------------------------------
def _harness(tests_dir: Path | None):
    if tests_dir is None or not (Path(tests_dir) / "opinfo" / "harness.py").exists():
        raise SystemExit(
            "coverage: the OpInfo sweep runs the harness in tests/opinfo of a torchneuron source checkout, "
            f"and {tests_dir}/opinfo has none: "
            "pass --tests-dir <checkout>/tests (or use --render-only to re-render existing --results)")
    sys.path.insert(0, str(tests_dir))
    try:
        from opinfo import harness  # lives with the tests (see the module docstring)
    except ImportError as err:
        raise SystemExit(f"coverage: the OpInfo harness needs the test extras ({err}): "
                         "pip install -e \".[test]\" in the checkout") from err
    return harness


def _enable_jax_cache():
    """Re-sweeps reuse compiled executables through JAX's persistent cache."""
    path = os.environ.get("TORCHNEURON_COVERAGE_JAX_CACHE",
                          str(Path.home() / ".cache" / "torchneuron" / "opinfo-jax"))
    if path:
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _tasks(harness, ops, checks, dtypes):
    tasks = []
    for name, op in harness.OPS.items():
        if ops and not any(p == name or (p.endswith("*") and name.startswith(p[:-1])) for p in ops):
            continue
        for check in checks:
            for dtype in harness.dtypes_for(op, check):
                dname = str(dtype).replace("torch.", "")
                if dtypes and dname not in dtypes:
                    continue
                tasks.append((name, getattr(torch, dname), check))
    return tasks


def _results(path: Path) -> resumable.ResultsFile:
    """Per-sample rows, then one "done" row per (entry, dtype, check): the task it completes."""
    return resumable.ResultsFile(path, lambda r: (r["op"], r["dtype"], r["check"]) if r.get("index") == "done" else None)


def _task_key(task) -> tuple:
    name, dtype, check = task
    return name, str(dtype).replace("torch.", ""), check


def sweep(args, tasks=None) -> None:
    """Run ``tasks`` (default: those the arguments select) in this process."""
    harness = _harness(args.tests_dir)
    if not args.no_jax_cache:
        _enable_jax_cache()
    torchneuron.config.fallback = "silent"
    if tasks is None:
        tasks = _tasks(harness, args.ops, args.checks, args.dtypes)
    results = _results(Path(args.results))
    done = results.done() if args.resume else {}
    if not args.resume and not args.worker:
        results.clear()
    for name, dtype, check in tasks:
        dname = str(dtype).replace("torch.", "")
        if (name, dname, check) in done:
            continue
        start = time.perf_counter()
        counts = Counter()
        try:
            for r in harness.run(harness.OPS[name], dtype, check, limit=args.limit, shapes=args.shapes):
                results.append(r.as_dict())
                counts[r.status] += 1
        finally:
            harness.clear_caches()
        results.append({"op": name, "dtype": dname, "check": check, "index": "done",
                        "available": harness.sample_counts.get((name, dname, check)),
                        "command": args.command, "seconds": round(time.perf_counter() - start, 2)})
        if not args.quiet:
            print(f"{name:55s} {dname:9s} {check:7s} {dict(counts)} "
                  f"{time.perf_counter() - start:.1f}s", flush=True)


def sweep_parallel(args) -> None:
    """``--jobs N``: N worker processes share the tasks; a worker that dies is replaced and the
    entry it was on is recorded as a failing sample."""
    harness = _harness(args.tests_dir)
    results = _results(Path(args.results))
    if not args.resume:
        results.clear()
    tasks = [_task_key(t) for t in _tasks(harness, args.ops, args.checks, args.dtypes)]
    folder = Path(args.results).parent
    folder.mkdir(parents=True, exist_ok=True)

    def command(todo):
        fd, tasks_file = tempfile.mkstemp(prefix="coverage-tasks-", suffix=".json", dir=folder)
        with os.fdopen(fd, "w") as f:
            json.dump(todo, f)
        cmd = [*resumable.tool_command("coverage"), "--worker", tasks_file, "--resume",
               "--results", str(args.results), "--tests-dir", str(args.tests_dir)]
        if args.limit is not None:
            cmd += ["--limit", str(args.limit)]
        cmd += ["--shapes", args.shapes]
        if args.no_jax_cache:
            cmd.append("--no-jax-cache")
        if args.quiet:
            cmd.append("--quiet")
        return cmd

    def crashed(task, code):
        name, dname, check = task
        results.append({"op": name, "dtype": dname, "check": check, "index": -1, "status": "fail", "desc": "",
                        "detail": f"the sweep's worker process died (exit code {code}) running this entry",
                        "fallbacks": [], "decomposed": []})
        results.append({"op": name, "dtype": dname, "check": check, "index": "done", "available": None,
                        "command": args.command, "seconds": 0})

    resumable.run_in_workers(tasks, args.jobs, results, command, crashed,
                             env={**os.environ, _COMMAND_ENV: args.command})
    for leftover in folder.glob("coverage-tasks-*.json"):
        leftover.unlink(missing_ok=True)


def _worker_tasks(tasks_file: str) -> list:
    with open(tasks_file) as f:
        tasks = json.load(f)
    os.unlink(tasks_file)
    return [(name, getattr(torch, dname), check) for name, dname, check in tasks]


def load_results(path: Path) -> list[dict]:
    rows = {}
    for r in _results(path).rows():
        if r.get("index") == "done":
            available[(r["op"], r["dtype"], r["check"])] = r.get("available")
            commands[(r["op"], r["dtype"], r["check"])] = r.get("command") or "not recorded"
            continue
        rows[(r["op"], r["dtype"], r["check"], r["index"])] = r
    return list(rows.values())


# (entry, dtype, check) -> samples OpInfo generates there, from the last load_results (a sweep with
# --limit runs only some of them; the report says how many).
available: dict[tuple[str, str, str], int | None] = {}
commands: dict[tuple[str, str, str], str] = {}   # ... and the sweep command that produced them
_COMMAND_ENV = "TORCHNEURON_COVERAGE_COMMAND"   # a --jobs worker records its parent's command


# -- Core ATen IR, statically -----------------------------------------------------------------------
def core_aten() -> list[dict]:
    has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
    rows = []
    for packet_name in dir(torch.ops.aten):
        packet = getattr(torch.ops.aten, packet_name, None)
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            continue
        for ov in packet.overloads():
            op = getattr(packet, ov)
            if torch.Tag.core not in op.tags:
                continue
            key = registry_name(op)
            name = op.name()
            if key in registry.LOWERINGS and not registry.LOWERINGS[key].graph_only:
                how, status = "lowering", "native"
            elif has_kernel(name, "PrivateUse1"):
                how, status = "neuron kernel", "native"
            elif _backend_independent(name):
                how, status = "backend-independent kernel", "native"
            elif op in decomposition_table:
                how, status = "decomposition", "decomposed"
            else:
                how, status = "none", "CPU fallback"
            rows.append({"op": key, "status": status, "how": how})
    return sorted(rows, key=lambda r: r["op"])


def _backend_independent(name: str) -> bool:
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    return (has(name, "CompositeExplicitAutograd") or has(name, "CompositeExplicitAutogradNonFunctional")
            or has(name, "CompositeImplicitAutograd"))


# -- rendering --------------------------------------------------------------------------------------
def _pct(a, b):
    return f"{100.0 * a / b:.1f}%" if b else "n/a"


def summarise(rows: list[dict]) -> dict:
    by = defaultdict(Counter)                 # (op, dtype, check) -> status counts
    fallbacks = defaultdict(Counter)          # op -> fallback op counts
    decomposed = defaultdict(set)
    reasons = defaultdict(Counter)            # op -> expectation reason counts
    failures = defaultdict(list)
    cpu_errors = Counter()                    # (op, dtype, check) -> samples CPU and neuron both reject
    for r in rows:
        if r["status"] == "cpu_error":
            cpu_errors[(r["op"], r["dtype"], r["check"])] += 1
            continue
        by[(r["op"], r["dtype"], r["check"])][r["status"]] += 1
        for f in r.get("fallbacks", ()):
            fallbacks[r["op"]][f] += 1
        decomposed[r["op"]].update(r.get("decomposed", ()))
        if r["status"] == "expected":
            reasons[r["op"]][r["detail"].split(" [", 1)[0]] += 1
        if r["status"] == "fail":
            failures[r["op"]].append(r)
    return {"by": by, "fallbacks": fallbacks, "decomposed": decomposed, "reasons": reasons,
            "failures": failures, "cpu_errors": cpu_errors}


def op_status(counts: Counter, decomposed) -> str:
    if counts["fail"]:
        return "failing"
    if counts["fallback"]:
        return "CPU fallback"
    if not (counts["native"] or counts["expected"]):
        return "no samples"
    if not counts["native"] and counts["expected"]:
        return "expected failures"
    return "decomposed" if decomposed else "native"


def _versions() -> str:
    return (f"torch {torch.__version__}, jax {jax.__version__}, torchneuron {torchneuron.__version__}, "
            f"Python {platform.python_version()}, PJRT platform {torchneuron.config.platform}")


def render(rows: list[dict], core: list[dict]) -> str:
    s = summarise(rows)
    by = s["by"]
    ops = sorted({k[0] for k in by})
    totals = Counter()
    per_check = defaultdict(Counter)
    for (_op, dtype, check), c in by.items():
        per_check[(dtype, check)].update(c)
        totals.update(c)
    f32 = per_check[("float32", "forward")]
    f32_total = sum(f32.values())
    # Gradient target: autograd-capable entries whose float32 gradient samples all pass natively.
    grad_entries = [op for op in ops if sum(by[(op, "float32", "grad")].values())]
    grad_native = [op for op in grad_entries
                   if by[(op, "float32", "grad")]["native"] == sum(by[(op, "float32", "grad")].values())]
    wrong = totals["fail"]

    out = []
    w = out.append
    w("# ATen coverage of the neuron device\n")
    w("Generated by `python -m tools.coverage` -- do not edit by hand. "
      f"Last run: {datetime.date.today().isoformat()}; {_versions()}.\n")
    groups = [k for k, c in by.items() if sum(c.values())]   # by is a defaultdict: skip probed keys
    runs = Counter(commands.get(k, "not recorded") for k in groups)
    w("Produced by these sweeps (entry/dtype/check groups each):\n")
    for cmd, n in sorted(runs.items(), key=lambda kv: -kv[1]):
        w(f"- `{cmd}`: {n}")
    w("")
    ran = sum(sum(by[k].values()) for k in groups)
    rejected = sum(s["cpu_errors"][k] for k in groups)
    known = [available.get(k) for k in groups]
    if all(n is not None for n in known) and known:
        total = sum(known)
        scope = "every sample" if ran + rejected >= total else (
            f"a sample of the sweep: the leading samples of each entry, dtype and check ({_pct(ran, total)} "
            "of the samples OpInfo generates for them; the complete sweep is `pytest -m slow tests/opinfo` "
            "or the commands above without `--limit`)")
        w(f"Scope: {ran} samples run of {total} -- {scope}."
          + (f" {rejected} further samples are not counted: CPU rejects them and so does neuron (an invalid sample is "
             "no test of neuron)." if rejected else "") + "\n")
    w("Every OpInfo sample (PyTorch's `op_db`, `torch.testing._internal.common_methods_invocations`) "
      "runs on CPU and on neuron and the results are compared. **native**: matched with no CPU fallback "
      "during the op (decompositions into lowered ops count as native); **fallback**: matched, but some "
      "ATen op ran on CPU; **expected**: failed, and `tests/opinfo/expectations.py` gives the reason; "
      "**fail**: a mismatch or an error nobody explained. Random ops are checked by shape, dtype, range, "
      "reproducibility under a seed, and (forward) their distribution: a two-sample Kolmogorov-Smirnov test "
      "(alpha 1e-3) of values drawn on neuron against values drawn on CPU over 12 or more seeds.\n")
    w("## Targets\n")
    w("| target | measured | goal |")
    w("|---|---|---|")
    w(f"| float32 forward samples passing natively | {f32['native']} / {f32_total} = "
      f"{_pct(f32['native'], f32_total)} | >= 95% |")
    w(f"| float32 forward samples passing or in the expectations table | "
      f"{f32['native'] + f32['fallback'] + f32['expected']} / {f32_total} = "
      f"{_pct(f32['native'] + f32['fallback'] + f32['expected'], f32_total)} | 100% |")
    w(f"| autograd-capable entries whose float32 gradient passes natively | {len(grad_native)} / "
      f"{len(grad_entries)} = {_pct(len(grad_native), len(grad_entries))} | >= 90% |")
    w(f"| samples that produce a wrong answer (or error) without an expectation | {wrong} | 0 |\n")

    w("## Totals per dtype and check\n")
    w("| dtype | check | samples | native | fallback | expected | fail | native % |")
    w("|---|---|---|---|---|---|---|---|")
    for (dtype, check) in sorted(per_check, key=lambda k: (k[1], k[0])):
        c = per_check[(dtype, check)]
        n = sum(c.values())
        w(f"| {dtype} | {check} | {n} | {c['native']} | {c['fallback']} | {c['expected']} | {c['fail']} | "
          f"{_pct(c['native'], n)} |")
    n = sum(totals.values())
    w(f"| **all** | | {n} | {totals['native']} | {totals['fallback']} | {totals['expected']} | "
      f"{totals['fail']} | {_pct(totals['native'], n)} |\n")

    core_counts = Counter(r["status"] for r in core)
    w("## Core ATen IR\n")
    w(f"{len(core)} overloads tagged `core`: " + ", ".join(f"{v} {k}" for k, v in sorted(core_counts.items()))
      + ". *backend-independent kernel*: PyTorch's own composite or metadata kernel, which runs unchanged on "
      "neuron (views, `sym_*`, ...).\n")
    w("| overload | status | how |")
    w("|---|---|---|")
    for r in core:
        w(f"| `{r['op']}` | {r['status']} | {r['how']} |")
    w("")

    w("## Per OpInfo entry\n")
    w("Counts are native/fallback/expected/fail samples. Status: *native*, *decomposed* (native, and a "
      "PyTorch decomposition was used), *CPU fallback*, *expected failures* (all non-passing samples "
      "explained), *failing*.\n")
    dtypes_checks = [("float32", "forward"), ("bfloat16", "forward"), ("int64", "forward"),
                     ("bool", "forward"), ("float32", "grad")]
    w("| entry | status | " + " | ".join(f"{d} {c}" for d, c in dtypes_checks) + " | notes |")
    w("|---|---|" + "---|" * len(dtypes_checks) + "---|")
    for op in ops:
        allc = Counter()
        cells = []
        for d, c in dtypes_checks:
            cnt = by.get((op, d, c))
            if not cnt:
                cells.append("")
                continue
            allc.update(cnt)
            cells.append("/".join(str(cnt[k]) for k in STATUSES))
        notes = []
        if s["fallbacks"][op]:
            notes.append("CPU: " + ", ".join(f"`{k}`" for k in sorted(s["fallbacks"][op])))
        for reason in s["reasons"][op]:
            notes.append(reason)
        status = op_status(allc, s["decomposed"][op])
        w(f"| `{op}` | {status} | " + " | ".join(cells) + " | " + "; ".join(notes).replace("|", "\\|") + " |")
    w("")
    if s["failures"]:
        w("## Failing samples\n")
        for op in sorted(s["failures"]):
            for r in s["failures"][op][:5]:
                w(f"- `{op}` {r['dtype']} {r['check']} #{r['index']} `{r['desc'][:80]}`: "
                  f"{r['detail'][:200]}")
        w("")
    return "\n".join(out)


# -- the bucketed-shapes sweep (--shapes bucketed) ----------------------------------------------------
BUCKETED_HEADER = "## Bucketed shapes"
BUCKETED_STATUSES = ("native", "fallback", "static-fallback", "graph-break", "dynamo", "unpadded", "expected", "fail")


def _reasons(rows, status, split):
    """reason -> (samples, entries) over the rows of ``status``; ``split`` cuts a detail into reasons."""
    samples, entries = Counter(), defaultdict(set)
    for r in rows:
        if r["status"] != status:
            continue
        for reason in split(r["detail"]):
            samples[reason] += 1
            entries[reason].add(r["op"])
    return [(reason, n, sorted(entries[reason])) for reason, n in samples.most_common()]


def _static_reasons(detail):
    part = next((p for p in detail.split(" | ") if p.startswith("compiled at exact shapes: ")), "")
    return [x for x in part[len("compiled at exact shapes: "):].split("; ") if x]


def _break_reasons(detail):
    part = next((p for p in detail.split(" | ") if p.startswith("graph breaks: ")), "")
    return [x[:100] for x in part[len("graph breaks: "):].split("; ") if x]


def _names(ops, n=12):
    shown = ", ".join(f"`{o}`" for o in ops[:n])
    return shown + (f" and {len(ops) - n} more" if len(ops) > n else "")


def render_bucketed(rows: list[dict]) -> str:
    """The "Bucketed shapes" section of docs/coverage.md, from a ``--shapes bucketed`` sweep."""
    counted = [r for r in rows if r["status"] != "cpu_error"]
    groups = sorted({(r["op"], r["dtype"], r["check"]) for r in counted})
    per_check = defaultdict(Counter)
    for r in counted:
        per_check[(r["dtype"], r["check"])][r["status"]] += 1
    totals = Counter(r["status"] for r in counted)
    out = []
    w = out.append
    w(f"{BUCKETED_HEADER}\n")
    w("Generated by `python -m tools.coverage --shapes bucketed` (`tests/opinfo/bucketed.py`) -- do not edit by "
      f"hand. Last run: {datetime.date.today().isoformat()}; {_versions()}.\n")
    w("Every sample's call is compiled with `torch.compile(backend=\"neuron\")` and `config.shapes = \"bucketed\"` "
      "(the default `pow2` ladder), every dim of size >= 2 of every tensor argument marked dynamic "
      "(`torch._dynamo.mark_dynamic`; a dim the program specialises is retried with `maybe_mark_dynamic`), so "
      "OpInfo's sizes (mostly 2 to 20, none on a bucket boundary) run padded to their bucket; results are "
      "compared with CPU eager on the same sample, with the eager sweep's tolerances. **native**: matched, every "
      "graph ran at padded sizes; **fallback**: matched, some op ran on CPU or a graph with an unlowered op ran "
      "eagerly; **static-fallback**: matched, but a graph had an op without a dynamic-shape rule and compiled "
      "at its exact shapes (counted in `metrics()[\"extra\"][\"bucketed_fallbacks\"]`; not a test of padding); "
      "**graph-break**: matched, but Dynamo broke the graph; **dynamo**: Dynamo/AOTAutograd refused the "
      "program (nothing ran bucketed); **unpadded**: matched, but nothing had a dim to pad (scalars, size-1 "
      "dims) or Dynamo specialised every marked dim; **expected**: failed, and `tests/opinfo/expectations.py` "
      "names the failure; **fail**: a wrong result or an error raised by neuron. A padded box is read with "
      "zeros in its pad, so an unmasked sum or matmul over a pad still matches; `--poison-pads` (in the commands "
      "below where used) makes every input's pad NaN inside the compiled function to catch those.\n")
    runs = Counter(commands.get(k, "not recorded") for k in groups)
    w("Produced by these sweeps (entry/dtype/check groups each):\n")
    for cmd, n in sorted(runs.items(), key=lambda kv: -kv[1]):
        w(f"- `{cmd}`: {n}")
    w("")
    known = [available.get(k) for k in groups]
    rejected = len(rows) - len(counted)
    if known and all(n is not None for n in known):
        total = sum(known)
        scope = "every sample" if len(rows) >= total else (
            f"the leading samples of each entry, dtype and check ({_pct(len(rows), total)} of the samples OpInfo "
            "generates for them)")
        w(f"Scope: {len(counted)} samples of {len(groups)} entry/dtype/check groups, {total} samples available "
          f"-- {scope}." + (f" {rejected} further samples are not counted: CPU rejects them and so does neuron."
                            if rejected else "") + "\n")
    w("| dtype | check | samples | " + " | ".join(BUCKETED_STATUSES) + " |")
    w("|---|---|---|" + "---|" * len(BUCKETED_STATUSES))
    for (dtype, check) in sorted(per_check, key=lambda k: (k[1], k[0])):
        c = per_check[(dtype, check)]
        w(f"| {dtype} | {check} | {sum(c.values())} | " + " | ".join(str(c[k]) for k in BUCKETED_STATUSES) + " |")
    w(f"| **all** | | {sum(totals.values())} | " + " | ".join(str(totals[k]) for k in BUCKETED_STATUSES) + " |\n")
    other = sorted(set(totals) - set(BUCKETED_STATUSES))
    if other:
        w("Other statuses: " + ", ".join(f"{k} {totals[k]}" for k in other) + "\n")

    fails = [r for r in counted if r["status"] == "fail"]
    w(f"### Failing samples ({len(fails)})\n")
    if not fails:
        w("None.\n")
    by_op = defaultdict(list)
    for r in fails:
        by_op[r["op"]].append(r)
    for op in sorted(by_op):
        rs = by_op[op]
        w(f"- `{op}` ({len(rs)}):")
        for r in rs[:3]:
            w(f"  - {r['dtype']} {r['check']} #{r['index']} `{r['desc'][:80]}`: {r['detail'][:300]}")
    if fails:
        w("")
    for status, title, split in (("static-fallback", "Compiled at exact shapes (no dynamic-shape rule)", _static_reasons),
                                 ("graph-break", "Graph breaks", _break_reasons),
                                 ("dynamo", "Refused by Dynamo", lambda d: [d[:120]])):
        reasons = _reasons(counted, status, split)
        w(f"### {title} ({totals[status]} samples)\n")
        if not reasons:
            w("None.\n")
            continue
        w("| reason | samples | entries |")
        w("|---|---|---|")
        for reason, n, ops in reasons:
            w(f"| {reason.replace('|', chr(92) + '|')} | {n} | {_names(ops)} |")
        w("")
    expected = _reasons(counted, "expected", lambda d: [d.split(" [", 1)[0][:120]])
    if expected:
        w(f"### Expected failures ({totals['expected']} samples)\n")
        for reason, n, ops in expected:
            w(f"- {reason} ({n} samples: {_names(ops)})")
        w("")
    return "\n".join(out)


def _splice(text: str, section: str) -> str:
    """``text`` with its "Bucketed shapes" section (the last one) replaced by ``section``."""
    head = text.split("\n" + BUCKETED_HEADER + "\n", 1)[0].rstrip("\n")
    return (head + "\n\n" + section.rstrip("\n") + "\n") if section else head + "\n"


def _section(text: str) -> str:
    parts = text.split("\n" + BUCKETED_HEADER + "\n", 1)
    return BUCKETED_HEADER + "\n" + parts[1] if len(parts) == 2 else ""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.coverage", description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", nargs="*", default=[], help="OpInfo entries to sweep (exact, or prefix*)")
    p.add_argument("--checks", nargs="*", default=["forward", "grad"], choices=["forward", "grad"])
    p.add_argument("--dtypes", nargs="*", default=[], help="e.g. float32 bfloat16 (default: all the harness runs)")
    p.add_argument("--limit", type=int, default=None, help="samples per entry/dtype/check (default: all)")
    p.add_argument("--jobs", type=int, default=1, help="worker processes")
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)   # a --jobs worker: its tasks file
    p.add_argument("--in-process", action="store_true",
                   help="run a --jobs 1 sweep in this process (a bucketed sweep otherwise uses a worker process)")
    p.add_argument("--shapes", choices=["static", "bucketed"], default="static",
                   help="bucketed: compile each sample with config.shapes='bucketed' at padded sizes, and write "
                        "the report's 'Bucketed shapes' section")
    p.add_argument("--poison-pads", action="store_true",
                   help="with --shapes bucketed: NaN in every input's pad (TORCHNEURON_OPINFO_POISON=1), so a "
                        "rule that does not mask shows even where a zero pad is harmless")
    p.add_argument("--results", default=None,
                   help=f"default: {DEFAULT_RESULTS} ({DEFAULT_BUCKETED_RESULTS} with --shapes bucketed)")
    p.add_argument("--output", default=str(DEFAULT_OUTPUT))
    p.add_argument("--tests-dir", type=Path, default=DEFAULT_TESTS,
                   help="a torchneuron source checkout's tests directory (default: this checkout's)")
    p.add_argument("--resume", action="store_true", help="skip entries already in --results")
    p.add_argument("--render-only", action="store_true", help="write the report from --results, run nothing")
    p.add_argument("--no-jax-cache", action="store_true", help="do not use JAX's persistent compilation cache")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    if args.poison_pads:
        os.environ["TORCHNEURON_OPINFO_POISON"] = "1"   # workers inherit it
    if args.results is None:
        args.results = str(DEFAULT_BUCKETED_RESULTS if args.shapes == "bucketed" else DEFAULT_RESULTS)
    args.command = os.environ.get(_COMMAND_ENV) or (
        "python -m tools.coverage " + " ".join(argv if argv is not None else sys.argv[1:])).strip()

    if args.worker:
        sweep(args, _worker_tasks(args.worker))
        return 0
    if not args.render_only:
        # A bucketed sweep always runs in worker processes, even with --jobs 1: a compiled sample
        # that kills its process (seen: "terminate called without an active exception") is then
        # recorded as failing and the sweep goes on.
        if args.jobs > 1 or (args.shapes == "bucketed" and not args.in_process):
            sweep_parallel(args)
        else:
            sweep(args)
    rows = load_results(Path(args.results))
    out = Path(args.output)
    existing = out.read_text() if out.exists() else ""
    if args.shapes == "bucketed":
        # Only the "Bucketed shapes" section: the eager sweep's report above it is kept.
        text = _splice(existing, render_bucketed(rows))
    else:
        text = _splice(render(rows, core_aten()), _section(existing))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"coverage: wrote {out} ({len(rows)} samples)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
