"""Turns collected runs into a report: census, costs, statistics, numerics and the verdict.

Pure Python over the JSON data of the runs (no torch import), so a report can be rebuilt or
compared anywhere.
"""

from __future__ import annotations

import math
import re
import time

from ..metrics import op_label
from ..runtime.sites import format_site
from . import buckets
from .env import KEY_FIELDS

REPORT_SCHEMA = "torchneuron.report/1"

DEFAULT_RTOL = 1e-3
DEFAULT_ATOL = 1e-5

# A problem "happens every step" when it shows up in at least this share of the steady-state steps
# (and in at least MIN_STEADY_HITS of them, so a single late event is not called a pattern).
EVERY_STEP_SHARE = 0.5
MIN_STEADY_HITS = 2

PATH_LABELS = {"native": "native", "decomposed": "decomposed", "cpu": "CPU fallback"}


# -- small helpers ----------------------------------------------------------------------------------
def num(x) -> float:
    if isinstance(x, str):
        return float(x)   # "nan", "inf", "-inf" from strict JSON
    return float(x)


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def latency_stats(seconds: list[float], samples: list) -> dict | None:
    if not seconds:
        return None
    total = sum(seconds)
    stats = {
        "steps": len(seconds),
        "mean_s": total / len(seconds),
        "min_s": min(seconds),
        "max_s": max(seconds),
        "p50_s": percentile(seconds, 50),
        "p95_s": percentile(seconds, 95),
        "p99_s": percentile(seconds, 99),
        "steps_per_s": len(seconds) / total if total > 0 else None,
        "samples_per_s": None,
    }
    if samples and all(s is not None for s in samples) and total > 0:
        stats["samples_per_s"] = sum(samples) / total
    return stats


def _finding(severity, kind, title, detail, **extra) -> dict:
    return {"severity": severity, "kind": kind, "title": title, "detail": detail, **extra}


def _site_text(site) -> str:
    return format_site(site, function=False)


# -- sections ---------------------------------------------------------------------------------------
def census(run: dict) -> list[dict]:
    m = run["metrics"]
    sites = {(s["op"], s["path"]): s["site"] for s in run.get("sites", [])}
    failures = {(f["op"], f["path"]): f for f in run.get("failures", [])}
    rows = {}
    for path, counter in (("native", m.get("op_calls", {})), ("decomposed", m.get("decompositions", {})),
                          ("cpu", m.get("fallbacks", {}))):
        for op, calls in counter.items():
            rows[(op, path)] = {"op": op, "path": path, "calls": calls, "failed": 0,
                                "site": sites.get((op, path))}
    for (op, path), f in failures.items():
        row = rows.setdefault((op, path), {"op": op, "path": path, "calls": f["count"], "failed": 0,
                                           "site": f.get("site")})
        row["failed"] = f["count"]
        row["error"] = f["error"]
        if row["site"] is None:
            row["site"] = f.get("site")
    order = {"cpu": 0, "decomposed": 1, "native": 2}
    return sorted(rows.values(), key=lambda r: (r["failed"] == 0, order[r["path"]], -r["calls"], r["op"]))


def custom_kernels(run: dict) -> list[dict]:
    """The torchneuron.kernel custom ops the run called: calls on every path (neuron eager, CPU,
    inside compiled graphs), executables compiled that contain them, first neuron call site."""
    m = run["metrics"]
    calls, compiles = m.get("custom_kernel_calls", {}), m.get("custom_kernel_compiles", {})
    sites = {s["op"]: s["site"] for s in run.get("sites", []) if s["path"] == "native"}
    return [{"kernel": name, "calls": calls.get(name, 0), "compiles": compiles.get(name, 0),
             "site": sites.get(name)}
            for name in sorted(set(calls) | set(compiles), key=lambda n: (-calls.get(n, 0), n))]


def _steady(run: dict, warmup: int) -> list[dict]:
    return run["steps"][warmup:] if run.get("steps") else []


def fallbacks(run: dict, warmup: int) -> list[dict]:
    steps = run.get("steps") or []
    steady = _steady(run, warmup)
    sites = {s["op"]: s["site"] for s in run.get("sites", []) if s["path"] == "cpu"}
    costs = run.get("fallback_costs", {})
    rows = []
    for op, calls in sorted(run["metrics"].get("fallbacks", {}).items(), key=lambda kv: -kv[1]):
        in_steps = [i + 1 for i, s in enumerate(steps) if s["fallbacks"].get(op)]
        steady_hits = sum(1 for s in steady if s["fallbacks"].get(op))
        cost = costs.get(op, {})
        rows.append({
            "op": op, "calls": calls, "site": sites.get(op),
            "steps_with_calls": len(in_steps), "first_step": in_steps[0] if in_steps else None,
            "steady_steps_with_calls": steady_hits, "steady_steps": len(steady),
            "calls_per_steady_step": (sum(s["fallbacks"].get(op, 0) for s in steady) / len(steady))
            if steady else None,
            "h2d_copies": cost.get("h2d_copies", 0), "h2d_bytes": cost.get("h2d_bytes", 0),
            "d2h_copies": cost.get("d2h_copies", 0), "d2h_bytes": cost.get("d2h_bytes", 0),
            "seconds": cost.get("seconds", 0.0),
            "in_hot_loop": _every_step(steady_hits, len(steady), single_ok=True),
        })
    return rows


def _every_step(hits: int, steady: int, single_ok: bool = False) -> bool:
    if steady == 0 or hits == 0:
        return False
    if hits < MIN_STEADY_HITS and not (single_ok and steady < MIN_STEADY_HITS):
        return False
    return hits / steady >= EVERY_STEP_SHARE


def compilation(run: dict, warmup: int, warm_run: dict | None) -> dict:
    m = run["metrics"]
    steps = run.get("steps") or []
    steady = _steady(run, warmup)
    out = {
        "executables_compiled": m["executables_compiled"],
        # Eager executables loaded from the persistent cache instead of compiled (a warm cache).
        "eager_cache_loads": m.get("eager_cache_loads", 0),
        "cold_loads": steps[0].get("loads", 0) if steps else m.get("eager_cache_loads", 0),
        "steady_loads": sum(s.get("loads", 0) for s in steady),
        "compile_seconds": m["compile_seconds"],
        "cache_hits": m["cache_hits"],
        # Lookups of the in-memory cache: hits, and misses (compiled, or loaded from disk).
        "cache_hit_rate": m["cache_hits"] / (m["cache_hits"] + m["executables_compiled"] + m.get("eager_cache_loads", 0))
        if (m["cache_hits"] + m["executables_compiled"] + m.get("eager_cache_loads", 0)) else None,
        "cold_compile_seconds": steps[0]["compile_seconds"] if steps else m["compile_seconds"],
        "cold_executables": steps[0]["compiles"] if steps else m["executables_compiled"],
        "steady_compiles": sum(s["compiles"] for s in steady),
        "steady_steps_compiling": sum(1 for s in steady if _compiled(s)),
        "graphs_compiled": m.get("graphs_compiled", 0),
        "graph_breaks": m.get("graph_breaks", {}),
        "recompiles": m.get("recompiles", {}),
        "graph_fallbacks": m.get("graph_fallbacks", {}),
        "persistent_cache": run.get("persistent_cache", {}),
        # Eager executables needed after the first step, by call site (step numbers count from 0),
        # each compiled or loaded from the persistent cache (runs recorded before the split: compiled).
        "compile_sites": [dict(e, steady_steps=sum(1 for s in e["steps"] if s >= warmup),
                               compiled=e.get("compiled", e["count"] - e.get("loaded", 0)),
                               loaded=e.get("loaded", 0))
                          for e in run.get("compile_sites", [])],
        "adaptive": _adaptive(m),
        "fusion_isolated": run.get("fusion_isolated") or [],
        "warm_start": None,
    }
    if warm_run is not None:
        wm = warm_run["metrics"]
        wsteps = warm_run.get("steps") or []
        out["warm_start"] = {
            "executables_compiled": wm["executables_compiled"],
            "compile_seconds": wm["compile_seconds"],
            "cache_hits": wm["cache_hits"],
            "graphs_compiled": wm.get("graphs_compiled", 0),
            "persistent_cache": warm_run.get("persistent_cache", {}),
            "first_step_seconds": wsteps[0]["seconds"] if wsteps else None,
            "status": warm_run.get("status", {}).get("outcome"),
        }
    return out


def _loaded_text(entry: dict) -> str:
    """" (2 compiled, 3 loaded from the persistent cache)" when some were loaded, else ""."""
    loaded = entry.get("loaded", 0)
    if not loaded:
        return ""
    return f" ({entry['count'] - loaded} compiled, {loaded} loaded from the persistent cache)"


def _isolated_finding(e: dict) -> dict:
    """Adaptive eager found a fused group that failed or differed and runs it op by op from now on."""
    ops = e.get("ops") or []
    site = next((s for s in e.get("sites") or [] if s), None)
    reason = e.get("reason") or "isolated"
    region = f" (of a region of {e['region_ops']} ops)" if e.get("region_ops") else ""
    error = (e.get("error") or "").strip().splitlines()
    detail = (f"A fused group of {len(ops)} op(s){region} {_ISOLATED_WHY.get(reason, reason)}, so it runs op by op "
              f"from now on: ops {', '.join(ops) or '–'}, at {_site_text(site)}"
              + (f". {error[0][:300]}" if error else "") + ". The rest of the region stays fused; please report "
              "the ops (a torchneuron bug).")
    return _finding("warning", "fusion_isolated", f"A fused group runs op by op ({reason})", detail,
                    ops=ops, site=site, reason=reason)


_ISOLATED_WHY = {"compile failed": "failed to compile", "run failed": "failed to run",
                 "differs": "gave results that differ from op-by-op execution"}


def _reasons(entry: dict) -> str:
    return ", ".join(f"{r} ×{n}" for r, n in sorted(entry["reasons"].items(), key=lambda x: -x[1]))


def _adaptive(m: dict) -> dict | None:
    """Adaptive eager's regions: how many ran fused, how many op by op and why (None if unused)."""
    if not m.get("regions_flushed"):
        return None
    return {
        "regions": m["regions_flushed"],
        "ops": m.get("region_ops", 0),
        "replayed_ops": m.get("region_replayed_ops", 0),
        "fused_runs": m.get("region_cache_hits", 0),
        "unfused_runs": dict(m.get("region_unfused", {})),
        "compiles": m.get("region_compiles", 0),
        "compile_seconds": m.get("region_compile_seconds", 0.0),
    }


def _compiled(step: dict) -> bool:
    """The step needed new executables: compiled, or loaded from the persistent cache (a loop that
    loads a new one every step on a warm cache compiles every step on a cold one)."""
    return step["compiles"] > 0 or step.get("loads", 0) > 0 or step["graphs_compiled"] > 0 \
        or step["recompiles"] > 0


def transfers(run: dict) -> dict:
    m = run["metrics"]
    costs = run.get("fallback_costs", {})
    via_fallback = {k: sum(c.get(k, 0) for c in costs.values())
                    for k in ("h2d_copies", "h2d_bytes", "d2h_copies", "d2h_bytes")}
    steps = run.get("steps") or []
    return {
        "h2d_copies": m["h2d_copies"], "h2d_bytes": m["h2d_bytes"],
        "d2h_copies": m["d2h_copies"], "d2h_bytes": m["d2h_bytes"],
        "via_fallback": via_fallback,
        "per_steady_step": {k: (sum(s[k] for s in steps[1:]) / (len(steps) - 1)) if len(steps) > 1 else None
                            for k in ("h2d_copies", "h2d_bytes", "d2h_copies", "d2h_bytes")},
        "sites": run.get("transfers", [])[:20],
    }


def performance(run: dict, warmup: int, baseline: dict | None) -> dict:
    steps = run.get("steps") or []
    steady = steps[warmup:]
    out = {
        "step_source": run.get("step_source"),
        "step_optimizer": run.get("step_optimizer"),
        "step_note": run.get("step_note"),
        "steps": len(steps),
        "warmup": min(warmup, len(steps)),
        "first_step_seconds": steps[0]["seconds"] if steps else None,
        "first_activity_seconds": run.get("first_activity_seconds"),
        "run_seconds": run.get("seconds"),
        "steady": latency_stats([s["seconds"] for s in steady], [s["samples"] for s in steady]),
        "series": [s["seconds"] for s in steps],
        "baseline": None,
    }
    if baseline is not None and baseline.get("steps"):
        bsteps = baseline["steps"]
        bsteady = bsteps[warmup:]
        b = {
            "first_step_seconds": bsteps[0]["seconds"],
            "steady": latency_stats([s["seconds"] for s in bsteady], [s["samples"] for s in bsteady]),
            "series": [s["seconds"] for s in bsteps],
            "step_note": baseline.get("step_note"),
        }
        if run.get("step_source") == baseline.get("step_source") == "optimizer" \
                and run.get("step_optimizer") != baseline.get("step_optimizer"):
            b["step_note"] = ((b["step_note"] + "; ") if b["step_note"] else "") + (
                f"its steps come from optimizer #{(baseline.get('step_optimizer') or 0) + 1}, this run's from "
                f"#{(run.get('step_optimizer') or 0) + 1} (by order of first step): they may not be the same loop")
        if b["steady"] and out["steady"] and b["steady"]["p50_s"]:
            b["p50_ratio"] = out["steady"]["p50_s"] / b["steady"]["p50_s"]
        out["baseline"] = b
    return out


def numerics(run: dict, baseline: dict | None, tolerances: dict) -> dict:
    """Compare tracked values index by index (the i-th ``track(name)`` call of each run)."""
    names = list(run.get("tracked", {}))
    if baseline is not None:
        names += [n for n in baseline.get("tracked", {}) if n not in names]
    defaults = run.get("tolerance") or {}
    out = {"baseline": baseline is not None, "values": []}
    for name in names:
        mine = run.get("tracked", {}).get(name)
        theirs = (baseline or {}).get("tracked", {}).get(name)
        rtol, atol = _tolerance(name, mine, tolerances, defaults)
        entry = {"name": name, "rtol": rtol, "atol": atol,
                 "count": len(mine["values"]) if mine else 0,
                 "baseline_count": len(theirs["values"]) if theirs else None,
                 "shape": (mine or theirs)["shape"],
                 "series": [_summary_value(v) for v in mine["values"]] if mine else [],
                 "baseline_series": [_summary_value(v) for v in theirs["values"]] if theirs else None,
                 "steps": mine["steps"] if mine else []}
        if mine and theirs:
            max_abs, max_rel, ok, first_bad, abs_series, rel_series, mismatch = _compare(
                mine["values"], theirs["values"], rtol, atol)
            entry.update(max_abs=max_abs, max_rel=max_rel, within_tolerance=ok, first_bad_index=first_bad,
                         abs_error=abs_series, rel_error=rel_series, shape_mismatch=mismatch,
                         compared=min(len(mine["values"]), len(theirs["values"])))
        out["values"].append(entry)
    return out


def _tolerance(name, mine, overrides, defaults):
    rtol = defaults.get("rtol", DEFAULT_RTOL)
    atol = defaults.get("atol", DEFAULT_ATOL)
    if mine:
        rtol = mine["rtol"] if mine.get("rtol") is not None else rtol
        atol = mine["atol"] if mine.get("atol") is not None else atol
    if name in overrides:
        rtol, atol = overrides[name]
    return rtol, atol


def _summary_value(values) -> float:
    """One number per step for plots: the value itself, or the mean of a tensor's elements."""
    xs = [num(v) for v in values]
    if len(xs) == 1:
        return xs[0]
    finite = [x for x in xs if math.isfinite(x)]
    return sum(finite) / len(finite) if finite else float("nan")


def _compare(mine, theirs, rtol, atol):
    max_abs = max_rel = 0.0
    ok = True
    first_bad = None
    abs_series, rel_series = [], []
    mismatch = False
    for i, (a_vals, b_vals) in enumerate(zip(mine, theirs)):
        if len(a_vals) != len(b_vals):
            mismatch = True
            ok = False
            first_bad = i if first_bad is None else first_bad
            abs_series.append(float("inf"))
            rel_series.append(float("inf"))
            continue
        step_abs = step_rel = 0.0
        step_ok = True
        for a, b in zip(a_vals, b_vals):
            a, b = num(a), num(b)
            if math.isnan(a) and math.isnan(b):
                continue
            if a == b:   # equal infinities included
                continue
            diff = abs(a - b)
            if math.isnan(diff):
                diff = float("inf")
            rel = diff / abs(b) if b not in (0.0,) and math.isfinite(b) else (0.0 if diff == 0 else float("inf"))
            step_abs = max(step_abs, diff)
            step_rel = max(step_rel, rel)
            if not diff <= atol + rtol * abs(b):
                step_ok = False
        abs_series.append(step_abs)
        rel_series.append(step_rel)
        max_abs = max(max_abs, step_abs)
        max_rel = max(max_rel, step_rel)
        if not step_ok:
            ok = False
            if first_bad is None:
                first_bad = i
    return max_abs, max_rel, ok, first_bad, abs_series, rel_series, mismatch


def memory(run: dict) -> dict | None:
    mem = run.get("memory")
    if not mem:
        return None
    steps = run.get("steps") or []
    return {"devices": mem["devices"],
            "peak_bytes": max((d["peak_bytes"] for d in mem["devices"]), default=0),
            "series": [s["memory"] for s in steps if s.get("memory") is not None]}


def environment_diff(current: dict, previous: dict) -> list[dict]:
    rows = []
    for key in KEY_FIELDS:
        a, b = current.get(key), previous.get(key)
        if a != b:
            rows.append({"field": key, "current": a, "baseline": b})
    if current.get("settings") != previous.get("settings"):
        rows.append({"field": "settings", "current": current.get("settings"), "baseline": previous.get("settings")})
    return rows


# -- verdict ----------------------------------------------------------------------------------------
def findings(run, baseline, sections, warmup) -> list[dict]:
    out = []
    status = run.get("status", {})
    steps = run.get("steps") or []
    steady = _steady(run, warmup)

    for f in run.get("failures", []):
        out.append(_finding(
            "blocker", "op_failed", f"{op_label(f['op'])} fails on neuron ({PATH_LABELS[f['path']]})",
            f"{f['error_type']}: {f['error'].splitlines()[0] if f['error'] else ''} — first at "
            f"{_site_text(f.get('site'))}, {f['count']} failing call(s).", op=f["op"], site=f.get("site")))
    if status.get("outcome") == "error":
        err = status.get("error") or {}
        out.append(_finding("blocker", "script_error", "The script did not finish",
                            f"{err.get('type')}: {(err.get('message') or '').splitlines()[0] if err.get('message') else ''}"
                            + (f" at {_site_text(err.get('site'))}" if err.get("site") else ""),
                            site=err.get("site")))
    if status.get("outcome") == "killed":
        out.append(_finding("blocker", "script_killed", "The script was killed",
                            status.get("message") or "No data came back from the run."))

    for row in sections["fallbacks"]:
        if row["in_hot_loop"]:
            out.append(_finding(
                "blocker", "fallback_in_loop", f"{op_label(row['op'])} runs on CPU inside the hot loop",
                f"{row['steady_steps_with_calls']} of {row['steady_steps']} steady-state steps call it "
                f"({row['calls']} calls in total, {row['h2d_bytes'] + row['d2h_bytes']} bytes copied "
                f"host<->device for it); first at {_site_text(row['site'])}.", op=row["op"], site=row["site"]))
        else:
            where = (f"in step {row['first_step']}" if row["first_step"] else "outside the marked steps") \
                if steps else "(no steps were marked, so the hot loop is unknown)"
            out.append(_finding(
                "warning", "fallback", f"{op_label(row['op'])} runs on CPU",
                f"{row['calls']} call(s), {where}; first at {_site_text(row['site'])}.",
                op=row["op"], site=row["site"]))

    comp = sections["compilation"]
    hits = comp["steady_steps_compiling"]
    recompile_reasons = comp["recompiles"]
    if _every_step(hits, len(steady)):
        detail = (f"{hits} of {len(steady)} steady-state steps compiled something "
                  f"({comp['steady_compiles']} eager executables"
                  + (f", {comp['steady_loads']} more loaded from the persistent cache" if comp["steady_loads"] else ""))
        if recompile_reasons:
            detail += f"; torch.compile recompiles: {sum(recompile_reasons.values())}"
        detail += "). Changing shapes? Pad or bucket them (torchneuron.pad_to_multiple)."
        if recompile_reasons:
            pattern, count = _top_pattern(recompile_reasons)
            detail += f" Most common recompile reason ({count}×): {pattern}"
        looping = [e for e in comp["compile_sites"] if e["steady_steps"] >= MIN_STEADY_HITS]
        if looping:
            detail += " Eager call sites that keep compiling: " + "; ".join(
                f"aten::{e['op']} at {_site_text(e['site'])} ({_reasons(e)})" for e in looping[:3])
        out.append(_finding("blocker", "recompiles_every_step", "Compiles in (almost) every step", detail))
    else:
        # A loop that keeps compiling at one call site, though not in every step.
        for e in comp["compile_sites"]:
            if e["steady_steps"] >= MIN_STEADY_HITS:
                out.append(_finding(
                    "warning", "compiling_loop", f"aten::{e['op']} keeps compiling at one call site",
                    f"{e['count']} new executable(s){_loaded_text(e)} in {e['steady_steps']} steady-state steps at "
                    f"{_site_text(e['site'])} ({_reasons(e)}). A loop that changes shapes, dtypes or "
                    "compiled-in arguments compiles again each time: keep them fixed (pad or bucket "
                    "shapes with torchneuron.pad_to_multiple).", op=e["op"], site=e["site"]))
        if hits >= MIN_STEADY_HITS:
            out.append(_finding("warning", "steady_compiles", "Compiles during steady state",
                                f"{hits} of {len(steady)} steady-state steps compiled new executables."))
        if recompile_reasons:
            out.append(_finding("warning", "recompiles", "torch.compile recompiled",
                                f"{sum(recompile_reasons.values())} recompile(s): "
                                + "; ".join(f"{r} ({n})" for r, n in recompile_reasons.items())))
    adaptive = comp.get("adaptive")
    unfused = (adaptive or {}).get("unfused_runs", {})
    if unfused.get("regions keep changing"):
        out.append(_finding(
            "warning", "adaptive_regions_change", "Adaptive eager regions keep changing",
            f"{unfused['regions keep changing']} region run(s) went op by op because most recent regions "
            "were new (changing shapes or op sequences), so compiling them was stopped; the program runs "
            "at plain eager speed there. Pad or bucket shapes (torchneuron.pad_to_multiple)."))
    if unfused.get("compile failed"):
        out.append(_finding(
            "warning", "adaptive_compile_failed", "Adaptive eager regions failed to compile",
            f"{unfused['compile failed']} region run(s) went op by op because their fused executable "
            "failed to compile (a torchneuron bug: please report it)."))
    for e in comp["fusion_isolated"]:
        out.append(_isolated_finding(e))
    if comp["graph_breaks"]:
        out.append(_finding("warning", "graph_breaks", "torch.compile graph breaks",
                            f"{sum(comp['graph_breaks'].values())} graph break(s): "
                            + "; ".join(f"{r} ({n})" for r, n in comp["graph_breaks"].items())))
    if comp["graph_fallbacks"]:
        out.append(_finding("warning", "graph_fallbacks", "Compiled graphs ran eagerly",
                            "Ops without a lowering made graphs run op by op: "
                            + ", ".join(f"{op} ({n})" for op, n in comp["graph_fallbacks"].items())))

    for op, count in run["metrics"].get("float64_downcasts", {}).items():
        site = run.get("float64_sites", {}).get(op)
        out.append(_finding("warning", "float64_downcast", f"float64 runs as float32 ({op_label(op)})",
                            f"{count} float64 result(s) of {op_label(op)} were computed as float32; first at "
                            f"{_site_text(site)}. Convert to float32 explicitly, or set "
                            "TORCHNEURON_FLOAT64=keep.", op=op, site=site))

    for v in sections["numerics"]["values"]:
        if v.get("within_tolerance") is False:
            if v.get("shape_mismatch"):
                detail = "shapes differ from the baseline's"
            else:
                detail = (f"max abs error {v['max_abs']:.3g}, max rel error {v['max_rel']:.3g} "
                          f"(rtol {v['rtol']:g}, atol {v['atol']:g}); first beyond tolerance at "
                          f"tracked value #{v['first_bad_index'] + 1}")
            out.append(_finding("blocker", "numeric_drift", f"'{v['name']}' drifts from the baseline", detail,
                                name=v["name"]))
        elif baseline is not None and (v["baseline_count"] in (None, 0) or v["count"] == 0):
            out.append(_finding("warning", "numeric_missing", f"'{v['name']}' tracked in one run only",
                                f"{v['count']} value(s) here, {v['baseline_count'] or 0} in the baseline."))
        elif baseline is not None and v["baseline_count"] != v["count"] and v.get("compared") \
                and not _budget_explains(run, baseline, v):
            out.append(_finding("warning", "numeric_missing", f"'{v['name']}' tracked a different number of times",
                                f"{v['count']} value(s) here, {v['baseline_count']} in the baseline; "
                                f"the first {v['compared']} were compared."))

    out += _drift_findings(sections.get("drift"))

    if baseline is not None:
        bstatus = baseline.get("status", {})
        if bstatus.get("outcome") in ("error", "killed") and status.get("outcome") not in ("error", "killed"):
            err = bstatus.get("error") or {}
            out.append(_finding("warning", "baseline_failed", "The baseline run failed",
                                f"{err.get('type', bstatus.get('outcome'))}: {err.get('message', '')}"[:500]))
        if baseline.get("role") == "baseline" and baseline["metrics"].get("op_calls"):
            out.append(_finding("warning", "baseline_not_cpu", "The CPU baseline ran neuron ops",
                                f"{sum(baseline['metrics']['op_calls'].values())} op(s) ran on neuron; the "
                                "device map missed a device argument, so parts of the comparison are not CPU."))

    if status.get("reason") == "timeout":
        out.append(_finding("warning", "timeout", "The run hit its time budget",
                            f"Stopped after {len(steps)} step(s); numbers cover only that part."))
    if not steps and status.get("outcome") != "killed":
        out.append(_finding("warning", "no_steps", "No steps detected",
                            "Neither torchneuron.step() nor optimizer.step() was called, so per-step latency, "
                            "hot-loop fallbacks and recompiles-per-step cannot be judged. Call "
                            "torchneuron.step() at the end of each iteration."))
    order = {"blocker": 0, "warning": 1}
    out.sort(key=lambda f: order[f["severity"]])
    return out


def _worst(diff: dict) -> str:
    """The worst element of a drift's difference: "cpu=1.5 neuron=1.25 at [0, 3]"."""
    if diff.get("note"):
        return diff["note"]
    els = diff.get("elements") or []
    text = f"max abs {num(diff['max_abs']):.3g}, max rel {num(diff['max_rel']):.3g}"
    if els:
        e = els[0]
        text += (f"; worst element [{', '.join(map(str, e['index']))}]: cpu {_value(e['cpu'])}, "
                 f"neuron {_value(e['neuron'])}")
    return text


def _value(v) -> str:
    """A drift element's value: a float, or a string (non-finite in strict JSON, or complex)."""
    return f"{v:.8g}" if isinstance(v, int | float) else str(v)


def _drift_findings(d: dict | None) -> list[dict]:
    """``--locate-drift``'s result as findings: where the model first leaves CPU's tolerance."""
    if not d:
        return []
    cap = d.get("captured")
    if cap is None:
        return [_finding("warning", "drift_not_located", "Drift was not located",
                         (d.get("note") or "no model was captured") + ".")]
    where = f"{cap['type']} first called at {_site_text(cap.get('site'))}"
    if d.get("error"):
        return [_finding("warning", "drift_not_located", "Drift localisation failed",
                         f"On {where}: {d['error'].splitlines()[0]}")]
    if not d.get("drift"):
        return []
    m = d["module"]
    label = m["name"] or "(model)"
    detail = (f"In {where}, {label} ({m['type']}, call {m['call']}, {m['phase']}) is the first module whose "
              f"output leaves CPU's tolerance (rtol {d['rtol']:g}, atol {d['atol']:g}): {_worst(m['difference'])}.")
    o = d.get("op")
    site = None
    if o is None:
        detail += (f" No single ATen op of it leaves the tolerance when re-run from CPU's inputs "
                   f"({d['ops_compared']} ops compared): " + (d.get("note") or "the error accumulates across ops") + ".")
    else:
        site = o.get("site")
        detail += (f" First op leaving it: {o['op']} (op {o['index']} of {d['ops_compared']}) at {_site_text(site)}: "
                   f"{_worst(o['difference'])}; dtypes neuron {o['input_dtypes']} -> {o['output_dtypes']}, "
                   f"cpu {o['cpu_input_dtypes']} -> {o['cpu_output_dtypes']}.")
        if o.get("float64_downcast"):
            detail += " Its float64 result ran as float32 (TORCHNEURON_FLOAT64=keep keeps float64)."
        elif o.get("upstream_float64_downcast"):
            detail += " An earlier op of this module had float64 downcast to float32."
        if o.get("cpu_fallback"):
            detail += " It ran as a CPU fallback."
        if o.get("fused"):
            detail += " It ran inside an adaptive eager fused region."
    return [_finding("warning", "drift_located", f"Drift starts in {label} ({m['type']})"
                     + (f" at {o['op']}" if o else ""), detail, module=m["name"],
                     op=o["op"] if o else None, site=site)]


def _top_pattern(reasons: dict) -> tuple[str, int]:
    """The most frequent reason, with numbers folded ("expected 3, actual 5" and "expected 5, actual 7"
    are one pattern); shown as its first concrete instance."""
    groups: dict[str, list] = {}
    for reason, n in reasons.items():
        g = groups.setdefault(re.sub(r"\d+", "#", reason), [reason, 0])
        g[1] += n
    reason, count = max(groups.values(), key=lambda g: g[1])
    return reason, count


def _budget_explains(run, baseline, value) -> bool:
    """A run cut short by its step or time budget tracks fewer values: that is not a mismatch."""
    shorter = run if value["count"] < value["baseline_count"] else baseline
    return (shorter.get("status") or {}).get("outcome") == "stopped"


def verdict(found: list[dict]) -> dict:
    blockers = sum(1 for f in found if f["severity"] == "blocker")
    warnings = sum(1 for f in found if f["severity"] == "warning")
    if blockers:
        status, text = "not_ready", f"NOT READY — {blockers} blocker(s), {warnings} warning(s)"
    elif warnings:
        status, text = "ready_with_warnings", f"READY WITH WARNINGS — {warnings} warning(s)"
    else:
        status, text = "ready", "READY — no blockers, no warnings"
    return {"status": status, "blockers": blockers, "warnings": warnings, "summary": text}


def build(run: dict, *, baseline: dict | None = None, warm: dict | None = None, warmup: int = 1,
          tolerances: dict | None = None, title: str | None = None, baseline_label: str | None = None,
          options: dict | None = None) -> dict:
    """The report as data: what render.py writes as Markdown, HTML and JSON."""
    sections = {
        "census": census(run),
        "custom_kernels": custom_kernels(run),
        "fallbacks": fallbacks(run, warmup),
        "compilation": compilation(run, warmup, warm),
        "transfers": transfers(run),
        "performance": performance(run, warmup, baseline),
        "numerics": numerics(run, baseline, tolerances or {}),
        "memory": memory(run),
        "shapes": buckets.advise(run["metrics"]),
        "drift": run.get("drift"),   # --locate-drift's localisation (None when not asked for)
    }
    found = findings(run, baseline, sections, warmup)
    env = run.get("environment") or {}
    report = {
        "schema": REPORT_SCHEMA,
        "title": title or "torchneuron migration-readiness report",
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": run.get("command"),
        "device_map": run.get("device_map") or {},
        "options": options or {},
        "verdict": verdict(found),
        "findings": found,
        "environment": env,
        "status": run.get("status", {}),
        "float64": [{"op": op, "count": n, "site": run.get("float64_sites", {}).get(op)}
                    for op, n in run["metrics"].get("float64_downcasts", {}).items()],
        **sections,
        "baseline": None,
        "runs": {"neuron": run},
    }
    if baseline is not None:
        report["runs"]["baseline"] = baseline
        report["baseline"] = {
            "label": baseline_label or baseline.get("role", "baseline"),
            "status": baseline.get("status", {}),
            "environment_diff": environment_diff(env, baseline.get("environment") or {}),
        }
    if warm is not None:
        report["runs"]["warm"] = warm
    return report


def empty_run(role: str, message: str, command=None, device_map=None) -> dict:
    """Stands in for a run that produced no data (crashed interpreter, killed at its time limit)."""
    zero_counters = {k: {} for k in ("op_calls", "fallbacks", "decompositions", "recompiles", "graph_breaks",
                                     "float64_downcasts", "graph_fallbacks", "region_unfused")}
    metrics = {"executables_compiled": 0, "compile_seconds": 0.0, "cache_hits": 0, "h2d_copies": 0,
               "h2d_bytes": 0, "d2h_copies": 0, "d2h_bytes": 0, "graphs_compiled": 0, "eager_cache_loads": 0,
               **zero_counters}
    return {"schema": "torchneuron.run/1", "role": role, "steps": [], "metrics": metrics, "sites": [],
            "failures": [], "fallback_costs": {}, "transfers": [], "tracked": {}, "memory": None,
            "status": {"outcome": "killed", "reason": None, "exit_code": None, "error": None, "message": message},
            "command": command, "device_map": device_map or {}, "environment": {}}
