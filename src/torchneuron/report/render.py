"""Writes a report (analyze.build's data) as Markdown, a self-contained HTML page, and JSON.

Both text formats come from one list of blocks, so they always say the same thing; the HTML page
adds inline SVG plots (no scripts, no external resources).
"""

from __future__ import annotations

import json
import math
import os
from html import escape

from ..runtime.sites import format_site
from . import buckets, svg
from .analyze import PATH_LABELS


class Code(str):
    """Inline code in a paragraph or table cell."""


# -- formatting -------------------------------------------------------------------------------------
def fmt_bytes(n) -> str:
    if n is None:
        return "–"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def fmt_s(s) -> str:
    if s is None:
        return "–"
    if isinstance(s, str):
        return s
    if s < 0:
        return "-" + fmt_s(-s)
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.0f} µs"


def fmt_num(v, digits=3) -> str:
    if v is None:
        return "–"
    if isinstance(v, str):
        return v
    if isinstance(v, int):
        return str(v)
    if not math.isfinite(v):
        return str(v)
    return f"{v:.{digits}g}"


def site_text(site) -> str:
    return format_site(site, function=False, missing="–")


def site_cell(site):
    if not site:
        return "–"
    code = site.get("code")
    return Code(site_text(site) + (f"  {code}" if code else ""))


# -- the document -----------------------------------------------------------------------------------
def blocks(report: dict) -> list[tuple]:
    b: list[tuple] = []
    v = report["verdict"]
    b.append(("h", 1, report["title"]))
    status = report.get("status") or {}
    cmd = " ".join(report.get("command") or [])
    line = ["Command: ", Code(cmd), " — "] if cmd else []
    line.append(f"{report['created']} — run {status.get('outcome', 'unknown')}"
                + (f" ({status['reason']})" if status.get("reason") else "")
                + (f", device map {_map_text(report['device_map'])}" if report.get("device_map") else ""))
    b.append(("p", line))

    # Verdict first.
    b.append(("h", 2, "Verdict"))
    b.append(("verdict", v["status"], v["summary"]))
    blockers = [f for f in report["findings"] if f["severity"] == "blocker"]
    warnings = [f for f in report["findings"] if f["severity"] == "warning"]
    if blockers:
        b.append(("h", 3, "Blockers"))
        b.append(("list", [[f["title"] + ": ", f["detail"]] for f in blockers]))
    if warnings:
        b.append(("h", 3, "Warnings"))
        b.append(("list", [[f["title"] + ": ", f["detail"]] for f in warnings]))
    if not blockers and not warnings:
        b.append(("p", ["No CPU fallbacks, failing ops, per-step recompiles, float64 downcasts or numeric "
                        "drift were found."]))
    err = status.get("error")
    if err and err.get("traceback"):
        b.append(("h", 3, "Script error"))
        b.append(("code", err["traceback"].strip()))

    _environment(b, report)
    _census(b, report)
    _custom_kernels(b, report)
    _fallbacks(b, report)
    _compilation(b, report)
    _shapes(b, report)
    _transfers(b, report)
    _performance(b, report)
    _numerics(b, report)
    _drift(b, report)
    _memory(b, report)
    return b


def _map_text(m: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in m.items())


def _environment(b, report):
    env = report.get("environment") or {}
    b.append(("h", 2, "Environment and versions"))
    rev = env.get("torchneuron_revision")
    rev_text = (rev[:12] + (" (uncommitted changes)" if env.get("torchneuron_dirty") else "")) if rev else "–"
    rows = [
        ("torchneuron", f"{env.get('torchneuron', '–')} (git {rev_text})"),
        ("torch", env.get("torch")), ("jax / jaxlib", f"{env.get('jax')} / {env.get('jaxlib')}"),
        ("PJRT platform", f"{env.get('pjrt_platform')} ({env.get('pjrt_version') or 'version unknown'})"),
        ("Device", f"{env.get('device_kind')} × {env.get('device_count')}"),
        ("Python", f"{env.get('python')} ({env.get('python_executable')})"),
        ("OS", env.get("os")), ("CPU", f"{env.get('cpu')} ({env.get('cpu_count')} logical cores)"),
        ("Container", env.get("container") or "–"), ("Host", env.get("host")),
        ("numpy", env.get("numpy")),
    ]
    if env.get("pjrt_error"):
        rows.append(("PJRT error", env["pjrt_error"]))
    b.append(("table", ["Component", "Version"], [[k, str(v)] for k, v in rows]))
    settings = env.get("settings") or {}
    if settings:
        b.append(("p", ["Non-default torchneuron settings:"]))
        b.append(("table", ["Setting", "Value"], [[Code(k), Code(repr(v))] for k, v in settings.items()]))
    else:
        b.append(("p", ["All torchneuron settings at their defaults."]))
    envvars = env.get("environment") or {}
    if envvars:
        b.append(("table", ["Environment variable", "Value"], [[Code(k), Code(v)] for k, v in envvars.items()]))
    base = report.get("baseline")
    if base and base.get("environment_diff"):
        b.append(("p", [f"Differences from the baseline ({base['label']}):"]))
        b.append(("table", ["Field", "This run", "Baseline"],
                  [[r["field"], str(r["current"]), str(r["baseline"])] for r in base["environment_diff"]]))


def _census(b, report):
    rows = report["census"]
    b.append(("h", 2, "Op census"))
    if not rows:
        b.append(("p", ["No ATen op ran through a neuron kernel."]))
    else:
        paths = {}
        for r in rows:
            paths[r["path"]] = paths.get(r["path"], 0) + 1
        b.append(("p", [f"{len(rows)} ATen op(s): "
                        + ", ".join(f"{n} {PATH_LABELS[p]}" for p, n in paths.items())
                        + f"; {sum(1 for r in rows if r['failed'])} failing. Call sites are the first call "
                          "from your code on each path."]))
        table = []
        for r in rows:
            path = PATH_LABELS[r["path"]]
            if r["failed"]:
                path = f"FAILED ({path}, {r['failed']}×)"
            table.append([Code(r["op"]), str(r["calls"]), path, site_cell(r["site"])])
        b.append(("table", ["Op", "Calls", "Path", "First call site"], table))
    f64 = report.get("float64") or []
    if f64:
        b.append(("p", ["float64 results computed as float32 (the device has no float64):"]))
        b.append(("table", ["Op", "Downcasts", "First call site"],
                  [[Code(r["op"]), str(r["count"]), site_cell(r["site"])] for r in f64]))


def _custom_kernels(b, report):
    rows = report.get("custom_kernels") or []
    if not rows:
        return
    b.append(("h", 3, "Custom kernels"))
    b.append(("p", [f"{len(rows)} torchneuron.kernel custom op(s). Calls count every path (neuron, CPU, "
                    "compiled graphs); compiles count the executables that contain the kernel."]))
    b.append(("table", ["Kernel", "Calls", "Compiles", "First call site"],
              [[Code(r["kernel"]), str(r["calls"]), str(r["compiles"]), site_cell(r["site"])] for r in rows]))


def _fallbacks(b, report):
    rows = report["fallbacks"]
    b.append(("h", 2, "CPU fallbacks"))
    if not rows:
        b.append(("p", ["None: every op ran on the device (natively or decomposed into native ops)."]))
        return
    table = []
    for r in rows:
        steady = (f"{r['steady_steps_with_calls']}/{r['steady_steps']}" if r["steady_steps"] else "–")
        table.append([Code(r["op"]), str(r["calls"]), "yes" if r["in_hot_loop"] else "no", steady,
                      f"{r['h2d_copies']} / {fmt_bytes(r['h2d_bytes'])}",
                      f"{r['d2h_copies']} / {fmt_bytes(r['d2h_bytes'])}", fmt_s(r["seconds"]),
                      site_cell(r["site"])])
    b.append(("table", ["Op", "Calls", "Hot loop", "Steady steps", "H→D copies / bytes", "D→H copies / bytes",
                        "Time", "First call site"], table))


def _compilation(b, report):
    c = report["compilation"]
    b.append(("h", 2, "Compilation"))
    rate = f"{c['cache_hit_rate']:.1%}" if c["cache_hit_rate"] is not None else "–"
    loads = c.get("eager_cache_loads", 0)
    cold_loads = c.get("cold_loads", 0)
    rows = [
        ["Eager executables compiled", str(c["executables_compiled"])
         + (f" ({loads} loaded from the persistent cache instead)" if loads else "")],
        ["Compile time (all)" + (", loads included" if loads else ""), fmt_s(c["compile_seconds"])],
        ["Cold compile (first step)", f"{c['cold_executables']} executables compiled"
         + (f", {cold_loads} loaded" if cold_loads else "") + f", {fmt_s(c['cold_compile_seconds'])}"],
        ["Executable cache hits", f"{c['cache_hits']} (hit rate {rate})"],
        ["Steady-state steps that compiled", str(c["steady_steps_compiling"])],
        ["torch.compile graphs compiled", str(c["graphs_compiled"])],
        ["Graph breaks", str(sum(c["graph_breaks"].values()))],
        ["Recompiles", str(sum(c["recompiles"].values()))],
    ]
    a = c.get("adaptive")
    if a:
        rows.append(["Adaptive eager regions", f"{a['regions']} ({a['ops']} ops, {a['replayed_ops']} replayed)"])
        rows.append(["Adaptive regions run fused / op by op",
                     f"{a['fused_runs']} / {sum(a['unfused_runs'].values())} segment runs"])
        rows.append(["Adaptive fused executables compiled (background)",
                     f"{a['compiles']} ({fmt_s(a['compile_seconds'])})"])
    pc = c.get("persistent_cache") or {}
    if pc:
        rows.append(["Persistent cache (this run)", f"{pc.get('cache_hits', 0)} hits, {pc.get('cache_misses', 0)} misses"])
    w = c.get("warm_start")
    if w:
        wpc = w.get("persistent_cache") or {}
        rows.append(["Warm start: executables compiled", f"{w['executables_compiled']} ({fmt_s(w['compile_seconds'])})"])
        rows.append(["Warm start: persistent cache hits",
                     f"{wpc.get('cache_hits', 0)} (compile time saved: {fmt_s(wpc.get('seconds_saved', 0.0))}, "
                     "as JAX measures it)"])
        rows.append(["Warm start: first step", fmt_s(w["first_step_seconds"])])
    b.append(("table", ["Measure", "Value"], rows))
    if c.get("compile_sites"):
        b.append(("p", ["Eager executables needed after the first step, by call site, compiled or loaded "
                        "from the persistent cache (a site that needs new ones in many steps is a loop "
                        "that keeps compiling; on a warm cache it loads instead):"]))
        b.append(("table", ["Op", "New executables", "Compiled", "Loaded", "Steps", "Reasons", "Call site"],
                  [[Code(e["op"]), str(e["count"]), str(e.get("compiled", e["count"])), str(e.get("loaded", 0)),
                    str(len(e["steps"])), ", ".join(f"{r} ×{n}" for r, n in e["reasons"].items()),
                    site_cell(e["site"])]
                   for e in c["compile_sites"][:20]]))
    for key, label in (("graph_breaks", "Graph break reasons"), ("recompiles", "Recompile reasons"),
                       ("graph_fallbacks", "Graphs run eagerly because of")):
        if c[key]:
            b.append(("p", [label + ":"]))
            b.append(("table", ["Reason", "Count"], [[Code(r), str(n)] for r, n in c[key].items()]))
    iso = c.get("fusion_isolated") or []
    if iso:
        b.append(("p", ["Fused groups isolated by adaptive eager (they run op by op from now on):"]))
        b.append(("table", ["Ops", "Reason", "Region ops", "Call site", "Error"],
                  [[Code(", ".join(e.get("ops") or [])), e.get("reason") or "–", str(e.get("region_ops") or "–"),
                    site_cell(next((s for s in e.get("sites") or [] if s), None)),
                    ((e.get("error") or "").strip().splitlines() or ["–"])[0][:200]] for e in iso]))
    if a and a["unfused_runs"]:
        b.append(("p", ["Adaptive regions run op by op, by reason:"]))
        b.append(("table", ["Reason", "Segment runs"], [[r, str(n)] for r, n in a["unfused_runs"].items()]))


def _shapes(b, report):
    dims = report.get("shapes") or []
    if not dims:
        return
    b.append(("h", 2, "Variable shapes"))
    b.append(("p", ["Each dynamic dimension compiles once per bucket it uses and pads every call up to "
                    "its bucket (docs/shapes.md). The proposal is the bucket set with the lowest "
                    "compiles × padded/real work among the least-padding sets of each size."]))
    for d in dims:
        b.append(("h", 3, d["dim"]))
        b.append(("p", [f"{d['calls']} calls, {d['distinct']} distinct sizes. Calls per size:"]))
        b.append(("table", ["Size", "Calls"], [[r, str(n)] for r, n in buckets.histogram_rows(d["histogram"])]))
        rows = []
        for label, c in (("today", d["today"]), ("proposed", d["proposal"]["cost"])):
            if c is None:
                continue
            rows.append([label, ", ".join(map(str, c["buckets"])), str(c["compiles"]), f"{100 * c['waste']:.1f}%",
                         str(c["over_largest"])])
        b.append(("table", ["Buckets", "Ladder", "Compiles", "Padding (of padded work)", "Calls above the largest"],
                  rows))
        if d["measured_compiles"]:
            b.append(("p", ["Compiles measured per bucket: " + ", ".join(
                f"{k}: {v}" for k, v in sorted(d["measured_compiles"].items())) + "."]))


def _transfers(b, report):
    t = report["transfers"]
    b.append(("h", 2, "Host↔device transfers"))
    per = t["per_steady_step"]
    rows = [
        ["Host → device", str(t["h2d_copies"]), fmt_bytes(t["h2d_bytes"]),
         fmt_num(per["h2d_copies"]), fmt_bytes(per["h2d_bytes"])],
        ["Device → host", str(t["d2h_copies"]), fmt_bytes(t["d2h_bytes"]),
         fmt_num(per["d2h_copies"]), fmt_bytes(per["d2h_bytes"])],
    ]
    b.append(("table", ["Direction", "Copies", "Bytes", "Copies per step", "Bytes per step"], rows))
    vf = t["via_fallback"]
    if vf["h2d_copies"] or vf["d2h_copies"]:
        b.append(("p", [f"Of these, CPU fallbacks caused {vf['h2d_copies']} host→device ({fmt_bytes(vf['h2d_bytes'])}) "
                        f"and {vf['d2h_copies']} device→host ({fmt_bytes(vf['d2h_bytes'])}) copies."]))
    if t["sites"]:
        b.append(("p", ["Where copies come from (largest first):"]))
        b.append(("table", ["Direction", "Copies", "Bytes", "Call site"],
                  [["H→D" if s["direction"] == "h2d" else "D→H", str(s["count"]), fmt_bytes(s["bytes"]),
                    site_cell(s["site"])] for s in t["sites"]]))


def _performance(b, report):
    p = report["performance"]
    b.append(("h", 2, "Performance"))
    if not p["steps"]:
        b.append(("p", [f"No steps detected (run took {fmt_s(p['run_seconds'])}). Mark steps with ",
                        Code("torchneuron.step()"), " or use an optimizer."]))
        return
    source = "torchneuron.step()" if p["step_source"] == "explicit" else "optimizer.step()"
    b.append(("p", [f"{p['steps']} steps marked by ", Code(source),
                    f"; the first {p['warmup']} are warm-up, the rest steady state. The first step runs from "
                    "the start of the script to the first step mark, so it includes set-up, uploads and compiles"
                    + (f" (the first neuron op ran at {fmt_s(p['first_activity_seconds'])})."
                       if p.get("first_activity_seconds") is not None else ".")]))
    notes = [f"This run: {p['step_note']}." if p.get("step_note") else None,
             f"Baseline: {p['baseline']['step_note']}." if (p.get("baseline") or {}).get("step_note") else None]
    if any(notes):
        b.append(("p", [" ".join(n for n in notes if n)]))
    s = p["steady"]
    base = p.get("baseline")
    bs = base["steady"] if base else None
    headers = ["Measure", "neuron"] + (["baseline"] if base else [])

    def row(label, mine, theirs=None):
        return [label, mine] + ([theirs if theirs is not None else "–"] if base else [])
    rows = [row("First step (cold)", fmt_s(p["first_step_seconds"]),
                fmt_s(base["first_step_seconds"]) if base else None)]
    if s:
        for key, label in (("p50_s", "Steady p50"), ("p95_s", "Steady p95"), ("p99_s", "Steady p99"),
                           ("mean_s", "Steady mean"), ("min_s", "Steady min"), ("max_s", "Steady max")):
            rows.append(row(label, fmt_s(s[key]), fmt_s(bs[key]) if bs else None))
        rows.append(row("Throughput (steps/s)", fmt_num(s["steps_per_s"]), fmt_num(bs["steps_per_s"]) if bs else None))
        if s["samples_per_s"] is not None:
            rows.append(row("Throughput (samples/s)", fmt_num(s["samples_per_s"]),
                            fmt_num(bs["samples_per_s"]) if bs else None))
        rows.append(row("Steady steps", str(s["steps"]), str(bs["steps"]) if bs else None))
    b.append(("table", headers, rows))
    if base and base.get("p50_ratio"):
        r = base["p50_ratio"]
        b.append(("p", [f"Steady-state p50 is {r:.2f}× the baseline's ({'slower' if r > 1 else 'faster'})."]))
    series = [{"label": "neuron", "x": list(range(1, len(p["series"]) + 1)), "y": p["series"]}]
    if base:
        series.append({"label": "baseline", "x": list(range(1, len(base["series"]) + 1)), "y": base["series"],
                       "dashed": True})
    ys = [y for sr in series for y in sr["y"] if y and y > 0]
    log = bool(ys) and max(ys) / min(ys) > 20
    hl = [{"label": "p50", "y": s["p50_s"]}, {"label": "p99", "y": s["p99_s"]}] if s else []
    b.append(("chart", svg.line_chart(series, title="Step latency (s)" + (", log scale" if log else ""),
                                      xlabel="step", ylabel="seconds", log_y=log, hlines=hl)))


def _numerics(b, report):
    n = report["numerics"]
    b.append(("h", 2, "Numerics"))
    if not n["values"]:
        b.append(("p", ["No values tracked. Call ", Code('torchneuron.track("loss", loss)'),
                        " each step to compare against a baseline run."]))
        return
    if not n["baseline"]:
        b.append(("p", ["No baseline run to compare with (use ", Code("--baseline cpu"), ")."]))
    rows = []
    for v in n["values"]:
        last = v["series"][-1] if v["series"] else None
        if "max_abs" in v:
            verdict = "within tolerance" if v["within_tolerance"] else "DRIFT"
            rows.append([Code(v["name"]), str(v["count"]), fmt_num(last), fmt_num(v["max_abs"]),
                         fmt_num(v["max_rel"]), f"{v['rtol']:g} / {v['atol']:g}", verdict])
        else:
            rows.append([Code(v["name"]), str(v["count"]), fmt_num(last), "–", "–",
                         f"{v['rtol']:g} / {v['atol']:g}", "not compared"])
    b.append(("table", ["Value", "Count", "Last", "Max abs error", "Max rel error", "rtol / atol", "Result"], rows))
    for v in n["values"]:
        xs = list(range(1, len(v["series"]) + 1))
        series = [{"label": "neuron", "x": xs, "y": v["series"]}]
        if v.get("baseline_series"):
            series.append({"label": "baseline", "x": list(range(1, len(v["baseline_series"]) + 1)),
                           "y": v["baseline_series"], "dashed": True})
        b.append(("chart", svg.line_chart(series, title=f"{v['name']}" + (" (mean of elements)" if v["shape"] else ""),
                                          xlabel="tracked value #", ylabel=v["name"])))
        if v.get("abs_error"):
            xs = list(range(1, len(v["abs_error"]) + 1))
            err = [{"label": "max abs error", "x": xs, "y": v["abs_error"]}]
            if not v["shape"] and v.get("baseline_series"):
                # For a scalar the allowed error is exact: atol + rtol * |baseline|.
                err.append({"label": "tolerance", "x": xs, "dashed": True,
                            "y": [v["atol"] + v["rtol"] * abs(b) for b in v["baseline_series"][:len(xs)]]})
            positive = [e for sr in err for e in sr["y"] if math.isfinite(e) and e > 0]
            log = bool(positive) and max(positive) / min(positive) > 20
            b.append(("chart", svg.line_chart(err, title=f"{v['name']}: |neuron − baseline|"
                                              + (" (log scale; exact matches on the bottom edge)" if log else ""),
                                              xlabel="tracked value #", ylabel="abs error", log_y=log,
                                              zeros_on_axis=True)))


def _drift(b, report):
    d = report.get("drift")
    if not d:
        return
    b.append(("h", 2, "Drift localisation"))
    cap = d.get("captured")
    if cap is None:
        b.append(("p", [f"Nothing to localise: {d.get('note') or 'no model was captured'}."]))
        return
    b.append(("p", [f"The first call of {cap['type']} (at ", Code(site_text(cap.get("site"))),
                    ") was run again after the script, in eval mode with the final weights, on CPU and on "
                    "neuron; each module's output, then each ATen op of the first drifting module, compared."]))
    if d.get("error"):
        b.append(("p", ["The localisation failed: ", Code(d["error"])]))
        return
    if not d.get("drift"):
        b.append(("p", [f"No drift: {d['modules_compared']} module outputs match CPU within rtol {d['rtol']:g}, "
                        f"atol {d['atol']:g}."]))
        return
    m, o = d["module"], d.get("op")
    rows = [["First module", Code(m["name"] or "(model)"), f"{m['type']}, call {m['call']}, {m['phase']}, "
             f"output {m['output']}"],
            ["Its difference", "", _diff_text(m["difference"])]]
    if o:
        rows += [["First op", Code(o["op"]), f"op {o['index']} of {d['ops_compared']}, {o['phase']}"],
                 ["Its difference", "", _diff_text(o["difference"])],
                 ["dtypes (neuron)", "", f"{', '.join(o['input_dtypes'])} -> {', '.join(o['output_dtypes'])}"],
                 ["dtypes (cpu)", "", f"{', '.join(o['cpu_input_dtypes'])} -> {', '.join(o['cpu_output_dtypes'])}"],
                 ["Call site", "", site_cell(o.get("site"))]]
        flags = [t for key, t in (("float64_downcast", "float64 ran as float32"),
                                  ("upstream_float64_downcast", "an earlier op had float64 run as float32"),
                                  ("cpu_fallback", "ran as a CPU fallback"),
                                  ("fused", "ran inside an adaptive fused region")) if o.get(key)]
        if flags:
            rows.append(["Notes", "", "; ".join(flags)])
    b.append(("table", ["", "Where", "What"], rows))
    if d.get("text"):
        b.append(("code", d["text"]))


def _diff_text(diff: dict) -> str:
    if diff.get("note"):
        return diff["note"]
    worst = "; ".join(f"[{','.join(map(str, e['index']))}] cpu {fmt_num(e['cpu'], 8)}, neuron {fmt_num(e['neuron'], 8)}"
                      for e in diff.get("elements") or [])
    return f"max abs {fmt_num(diff['max_abs'])}, max rel {fmt_num(diff['max_rel'])}" + (f"; worst: {worst}" if worst else "")


def _memory(b, report):
    m = report.get("memory")
    b.append(("h", 2, "Memory"))
    if not m:
        b.append(("p", ["No device memory data."]))
        return
    b.append(("table", ["Device", "Peak allocated", "Allocated at end"],
              [[f"neuron:{d['index']}", fmt_bytes(d["peak_bytes"]), fmt_bytes(d["allocated_bytes"])]
               for d in m["devices"]]))
    if len(m["series"]) > 1:
        b.append(("chart", svg.line_chart([{"label": "allocated at step end", "x": list(range(1, len(m["series"]) + 1)),
                                            "y": [x / 2**20 for x in m["series"]]}],
                                          title="Device memory (MiB)", xlabel="step", ylabel="MiB")))


# -- Markdown ---------------------------------------------------------------------------------------
def _md_inline(parts) -> str:
    if isinstance(parts, str):
        parts = [parts]
    out = []
    for p in parts:
        if isinstance(p, Code):
            if p:
                tick = "``" if "`" in p else "`"
                out.append(f"{tick}{p}{tick}")
        else:
            out.append(p)
    return "".join(out)


def _md_cell(c) -> str:
    return _md_inline([c]).replace("|", "\\|").replace("\n", " ")


def to_markdown(report: dict) -> str:
    lines = []
    for blk in blocks(report):
        kind = blk[0]
        if kind == "h":
            lines += ["#" * blk[1] + " " + blk[2], ""]
        elif kind == "p":
            lines += [_md_inline(blk[1]), ""]
        elif kind == "verdict":
            lines += [f"**{blk[2]}**", ""]
        elif kind == "list":
            lines += [f"- **{item[0].rstrip(': ')}**: {_md_inline(item[1:])}" for item in blk[1]] + [""]
        elif kind == "table":
            headers, rows = blk[1], blk[2]
            lines.append("| " + " | ".join(headers) + " |")
            lines.append("|" + "|".join("---" for _ in headers) + "|")
            lines += ["| " + " | ".join(_md_cell(c) for c in r) + " |" for r in rows]
            lines.append("")
        elif kind == "code":
            lines += ["```", blk[1], "```", ""]
        elif kind == "chart":
            pass   # plots are in report.html
    lines.append("Plots: see report.html. Full data: report.json.")
    return "\n".join(lines) + "\n"


# -- HTML -------------------------------------------------------------------------------------------
_CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2em auto;max-width:1100px;
color:#1f2328;padding:0 1em}
h1{font-size:1.6em}h2{border-bottom:1px solid #d0d7de;padding-bottom:.2em;margin-top:1.8em}
table{border-collapse:collapse;margin:.6em 0;font-size:13px}th,td{border:1px solid #d0d7de;padding:3px 8px;
text-align:left;vertical-align:top}th{background:#f6f8fa}code{font:12px ui-monospace,Menlo,Consolas,monospace;
background:#f6f8fa;padding:0 3px;border-radius:3px}pre{background:#f6f8fa;padding:.8em;overflow:auto;font-size:12px}
.verdict{font-size:1.25em;font-weight:600;padding:.5em .8em;border-radius:6px;display:inline-block}
.ready{background:#dafbe1;color:#116329}.ready_with_warnings{background:#fff8c5;color:#7d4e00}
.not_ready{background:#ffebe9;color:#a40e26}li{margin:.25em 0}
.chart{display:block;margin:.8em 0;font-size:11px}.chart .plot{fill:#fff;stroke:#d0d7de}
.chart .grid{stroke:#eaeef2}.chart .ref{stroke:#6e7781;stroke-dasharray:4 3}
.chart-title{font-weight:600;font-size:12px}.chart .tick{fill:#57606a}.chart .legend{fill:#1f2328}
"""


def _html_inline(parts) -> str:
    if isinstance(parts, str):
        parts = [parts]
    return "".join(f"<code>{escape(p)}</code>" if isinstance(p, Code) else escape(p) for p in parts if p != "")


def to_html(report: dict) -> str:
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           f"<title>{escape(report['title'])}</title><style>{_CSS}</style></head><body>"]
    for blk in blocks(report):
        kind = blk[0]
        if kind == "h":
            out.append(f"<h{blk[1]}>{escape(blk[2])}</h{blk[1]}>")
        elif kind == "p":
            out.append(f"<p>{_html_inline(blk[1])}</p>")
        elif kind == "verdict":
            out.append(f'<p><span class="verdict {escape(blk[1])}">{escape(blk[2])}</span></p>')
        elif kind == "list":
            out.append("<ul>" + "".join(f"<li><strong>{escape(item[0].rstrip(': '))}</strong>: "
                                        f"{_html_inline(item[1:])}</li>" for item in blk[1]) + "</ul>")
        elif kind == "table":
            head = "".join(f"<th>{escape(h)}</th>" for h in blk[1])
            body = "".join("<tr>" + "".join(f"<td>{_html_inline([c])}</td>" for c in r) + "</tr>" for r in blk[2])
            out.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
        elif kind == "code":
            out.append(f"<pre>{escape(blk[1])}</pre>")
        elif kind == "chart":
            out.append(blk[1])
    out.append('<p style="color:#57606a">Full data: report.json.</p></body></html>')
    return "\n".join(out) + "\n"


# -- JSON and files ---------------------------------------------------------------------------------
def jsonable(v):
    """Strict JSON: non-finite floats become strings."""
    if isinstance(v, float):
        if v != v:
            return "nan"
        if v in (float("inf"), float("-inf")):
            return "inf" if v > 0 else "-inf"
        return v
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [jsonable(x) for x in v]
    return v


def to_json(report: dict) -> str:
    return json.dumps(jsonable(report), indent=1, allow_nan=False)


def write(report: dict, folder: str, formats=("md", "html", "json")) -> dict[str, str]:
    os.makedirs(folder, exist_ok=True)
    written = {}
    for fmt, fn in (("md", to_markdown), ("html", to_html), ("json", to_json)):
        if fmt in formats:
            path = os.path.join(folder, f"report.{fmt}")
            with open(path, "w", encoding="utf-8") as f:
                f.write(fn(report))
            written[fmt] = path
    return written
