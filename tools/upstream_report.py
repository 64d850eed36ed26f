"""The upstream tests' results against the expectations: classification, the summary, stale
entries, version skew, ``--suggest``'s first guesses and the report (``docs/upstream.md``).
"""

from __future__ import annotations

import fnmatch
import re
from collections import Counter, defaultdict

from .upstream_results import FAILING, REASON_CLASSES, Expectations


def rerun_ids(recs: dict, patterns: str) -> list[str]:
    """The tests of one file's results that ``--rerun PATTERNS`` runs again."""
    pats = patterns.split(",")
    return sorted(t for t, r in recs.items() if t != "<collection>" and any(
        r["status"] in FAILING if p == "failing" else fnmatch.fnmatchcase(t, p) for p in pats))


def _seconds_left(recs: dict, total: int) -> float:
    seconds = [r.get("seconds") or 0.0 for t, r in recs.items() if t != "<collection>"]
    return (total - len(seconds)) * sum(seconds) / len(seconds) if seconds else 0.0


def _hours_left(results: dict, totals: dict, complete: set) -> str:
    left = sum(_seconds_left(results[f], totals[f]) for f in results if totals.get(f) and f not in complete)
    if not left:
        return ""
    return (f" At the mean time per test recorded so far, the rest of the sampled files needs about "
            f"{left / 3600:,.0f} hours of one worker on the machine that ran them (most of a test's time "
            "is compiling executables for its shapes).")


def _time_left(recs: dict, total: int) -> str:
    """The rest of a sampled file at the mean time per test recorded so far (on the machine that
    ran it; a uniform sample, so the mean carries over)."""
    if not any(t != "<collection>" for t in recs):
        return ""
    hours = _seconds_left(recs, total) / 3600
    return f"; about {hours:.0f} h to complete" if hours >= 1 else f"; about {hours * 60:.0f} min to complete"


def complete_files(results: dict, totals: dict) -> set:
    """Files whose every collected test has a result."""
    return {f for f, recs in results.items()
            if totals.get(f) and len(recs) - ("<collection>" in recs) >= totals[f]}


def classify(file: str, rec: dict, expectations: Expectations) -> tuple[str, str | None, str | None]:
    """(category, reason class, pattern) of one neuron result.

    The categories: "passed", "skipped-upstream" (PyTorch's own qualifiers), "expected" (an xfail
    entry's test failed with the text its ``match`` finds; a skip entry's test did not run, or ran
    again and crashed or timed out as its ``cause`` says), "mismatch" (an xfail entry's test failed
    with another text: unexpected), "failed" (no entry), "crashed" and "timeout" (unless a skip
    entry with that cause), "not-run" (not run and no skip entry covers it)."""
    status = rec["status"]
    match = expectations.match(file, rec["id"])
    pattern, entry = match if match else (None, None)
    if status == "not-run":
        if entry and entry["action"] == "skip":
            return "expected", entry["class"], pattern
        return "not-run", None, pattern
    if status in ("skipped", "xfailed-upstream"):
        return "skipped-upstream", None, None
    if status == "passed":
        # A pattern may cover passing tests too: stale_entries() judges each entry as a whole.
        return "passed", None, pattern
    if status in ("crashed", "timeout"):
        if entry and entry["action"] == "skip" and entry["cause"] == status:
            return "expected", entry["class"], pattern
        return status, None, pattern
    if entry and entry["action"] == "xfail" and expectations.matches_failure(entry, rec.get("message", "")):
        return "expected", entry["class"], pattern
    if entry:
        return "mismatch", None, pattern
    return "failed", None, None


def summarize(results: dict, expectations: Expectations, complete=None):
    per_file = {}
    details = defaultdict(list)
    skip_reasons = Counter()
    fallback_tests = Counter()
    for file, recs in results.items():
        c = Counter()
        for tid, rec in sorted(recs.items()):
            if tid == "<collection>":
                if rec["status"] == "collected":     # a later worker collected the file
                    continue
                c["collection-error"] += 1
                details["failed"].append((file, tid, rec["status"], rec.get("message", "")))
                continue
            cat, rclass, pattern = classify(file, rec, expectations)
            c["results"] += 1
            c[cat] += 1
            if cat == "expected":
                c["expected:" + rclass] += 1
            if cat == "passed" and rec.get("fallbacks"):
                c["passed-with-fallback"] += 1
                fallback_tests.update(rec["fallbacks"])
            if cat == "skipped-upstream":
                skip_reasons[_skip_reason(rec.get("message", ""))] += 1
            if cat in ("failed", "crashed", "timeout", "not-run"):
                details[cat].append((file, tid, rec["status"], rec.get("message", "")))
            if cat == "mismatch":
                details[cat].append((file, tid, rec["status"], f"not the failure `{pattern}` expects "
                                     f"(match = {expectations.entry(file, pattern)['match']!r}): "
                                     + rec.get("message", "")))
        c["stale"] = 0
        per_file[file] = c
    for file, pattern, why in stale_entries(results, expectations, complete):
        per_file[file]["stale"] += 1
        details["stale"].append((file, pattern, "stale", why))
    return per_file, details, skip_reasons, fallback_tests


def _skip_reason(message: str) -> str:
    message = re.sub(r"\b(float|int|uint|bfloat|complex)\d*\b|torch\.\w+", "<dtype>", message)
    return re.sub(r"\s+", " ", message)[:120] or "(no reason given)"


# A pattern is judged on a sample (not the complete file) only when it matched at least this many
# results there: a sample may hold only a pattern's passing tests.
STALE_SAMPLE_MIN = 20


def stale_entries(results: dict, expectations: Expectations, complete=None) -> list[tuple[str, str, str]]:
    """(file, pattern, why) of the entries none of whose results that ran is expected: every
    matching test passed, or failed otherwise than the entry says (an xfail entry's ``match``, a
    skip entry's ``cause`` when ``--retry-skips`` ran it again). An exact entry is judged on any
    result; a pattern on a file run completely (``complete``: those files; None: all), or on a
    sample where it matched at least ``STALE_SAMPLE_MIN`` results. Skip entries none of whose
    tests ran again are not judged (``never_retried``)."""
    seen = defaultdict(Counter)   # (file, pattern) -> counts of the categories of its results
    for file, recs in results.items():
        for rec in recs.values():
            if rec.get("id") == "<collection>":
                continue
            cat, _, pattern = classify(file, rec, expectations)
            if pattern is None or rec["status"] in ("not-run", "skipped", "xfailed-upstream"):
                continue
            seen[(file, pattern)][cat] += 1
    stale = []
    for (file, pattern), cats in sorted(seen.items()):
        n = sum(cats.values())
        is_pattern = any(ch in pattern for ch in "*?[")
        if cats["expected"] or (is_pattern and complete is not None and file not in complete
                                and n < STALE_SAMPLE_MIN):
            continue
        if cats["passed"] == n:
            why = f"every test this entry matches passes ({n})"
        else:
            why = (f"none of the {n} results it matches failed as the entry says ("
                   + ", ".join(f"{k} {v}" for k, v in sorted(cats.items())) + ")")
        stale.append((file, pattern, why))
    return stale


def never_retried(results: dict, expectations: Expectations) -> list[tuple[str, str]]:
    """Skip entries with tests in the results none of which ran again (``--retry-skips``)."""
    ran, skipped = set(), set()
    for file, recs in results.items():
        for tid, rec in recs.items():
            m = expectations.match(file, tid)
            if m and m[1]["action"] == "skip":
                (skipped if rec["status"] == "not-run" else ran).add((file, m[0]))
    return sorted(skipped - ran)


COLUMNS = [("results", "results"), ("passed", "passed"), ("failed", "failed (unexpected)"),
           ("skipped-upstream", "skipped by PyTorch's own qualifiers"),
           ("expected:not-supported-by-design", "expected: not supported by design"),
           ("expected:missing-lowering", "expected: missing lowering"),
           ("expected:missing-feature", "expected: missing feature"),
           ("expected:known-bug", "expected: known bug"),
           ("expected:test-assumes-cuda", "expected: test assumes CUDA"),
           ("expected:version-skew", "version skew"),
           ("mismatch", "failed otherwise than its entry says"),
           ("crashed", "crashed"), ("timeout", "timed out"), ("not-run", "not run, no entry"),
           ("stale", "stale expectations")]


def render(results: dict, expectations: Expectations, sources: dict, meta: dict,
           totals: dict | None = None) -> str:
    per_file, details, skip_reasons, fallback_tests = summarize(
        results, expectations, complete_files(results, totals or {}))
    total = Counter()
    for c in per_file.values():
        total.update(c)
    lines = [
        "# PyTorch's own test suite on neuron",
        "",
        "<!-- generated by `python -m tools.upstream` (`make upstream`); do not edit -->",
        "",
        "TorchNeuron states its quality as PyTorch's upstream device-generic tests run on the "
        "`neuron` device. The files below are PyTorch's own, unmodified; "
        "`instantiate_device_type_tests` builds their neuron classes from `PrivateUse1TestBase` "
        "(`PYTORCH_TESTING_DEVICE_ONLY_FOR=privateuse1`), with torchneuron registered before "
        "`common_device_type` builds its bases. Default settings: float64 runs as float32, ops "
        "without a lowering fall back to CPU with a warning (counted below).",
        "",
        f"Run: {meta.get('date', '?')}, torch {meta.get('torch', '?')}, jax {meta.get('jax', '?')}, "
        f"Python {meta.get('python', '?')}; per-test limit {meta.get('timeout', '?')} s.",
        "",
        "## Totals",
        "",
        f"- **{total['results']:,} results**: {total['passed']:,} passed "
        f"({total['passed-with-fallback']:,} of them used the CPU fallback for some op), "
        f"**{total['failed']:,} failed outside the expectations file**, "
        f"**{total['mismatch']:,} failed otherwise than their entry's `match` says**, "
        f"{total['skipped-upstream']:,} skipped by PyTorch's own qualifiers (CUDA-only, CPU-only, "
        f"native-device-only, dtype lists...), {total['expected']:,} expected failures or skips "
        f"with a reason in `tests/upstream/expectations.toml`, {total['crashed']:,} crashed, "
        f"{total['timeout']:,} timed out (a crash or a timeout is expected only under a `skip` "
        f"entry with that `cause`), {total['not-run']:,} not run without an entry, "
        f"{total['stale']:,} stale expectations.",
    ]
    for key, label in REASON_CLASSES.items():
        lines.append(f"  - {label}: {total['expected:' + key]:,}")
    totals = totals or {}
    complete = complete_files(results, totals)
    lines += ["", "## Per file", "",
              "| file | tests in its neuron classes | " + " | ".join(label for _, label in COLUMNS) + " | run |",
              "|---" * (len(COLUMNS) + 3) + "|"]
    for file in results:
        c = per_file[file]
        n = f"{totals[file]:,}" if totals.get(file) else "—"
        if not c["results"]:
            lines.append(f"| {file} | {n} | " + " | ".join("—" for _ in COLUMNS) + " | not run |")
            continue
        run = "complete" if file in complete else \
            f"sample ({100 * len(results[file]) / totals[file]:.1f}%{_time_left(results[file], totals[file])})" \
            if totals.get(file) else "sample"
        lines.append(f"| {file} | {n} | " + " | ".join(f"{c[k]:,}" for k, _ in COLUMNS) + f" | {run} |")
    lines.append(f"| **total** | **{sum(v for v in totals.values() if v):,}** | "
                 + " | ".join(f"**{total[k]:,}**" for k, _ in COLUMNS) + " | |")
    lines.append("")
    lines.append("A dash: the file was not run (see Sources). Where *results* is below the file's test "
                 "count, the complete run has not reached the rest yet (it resumes: `make upstream`); a "
                 "file's tests run in a fixed pseudo-random order, so its results so far are a uniform "
                 "sample of its classes, tests and ops. The classes run per file are listed in "
                 "`tools.upstream.FILES`." + _hours_left(results, totals, complete))
    lines += ["", "## Expectations by reason", ""]
    by_entry = defaultdict(Counter)
    for file, recs in results.items():
        for rec in recs.values():
            cat, rclass, pattern = classify(file, rec, expectations)
            if cat == "expected":
                by_entry[rclass][(file, pattern)] += 1
    for key, label in REASON_CLASSES.items():
        entries = by_entry.get(key)
        if not entries:
            continue
        lines += [f"### {label}", "", "| file | test or pattern | tests | reason |", "|---|---|---|---|"]
        for (file, pattern), n in sorted(entries.items(), key=lambda item: (item[0][0], item[0][1] or "")):
            entry = expectations.entry(file, pattern)
            lines.append(f"| {file} | `{pattern}` | {n} | {entry['reason']} |")
        lines.append("")
    for cat, title in (("failed", "Failing outside the expectations file"),
                       ("mismatch", "Failing otherwise than their entry says"), ("crashed", "Crashed"),
                       ("timeout", "Timed out"), ("not-run", "Not run, with no entry"),
                       ("stale", "Stale expectations")):
        if details.get(cat):
            lines += [f"## {title}", "", "| file | test | message |", "|---|---|---|"]
            for file, tid, _status, msg in details[cat][:300]:
                lines.append(f"| {file} | `{tid}` | {msg.replace('|', '/')[:200]} |")
            lines.append("")
    if fallback_tests:
        lines += ["## CPU fallbacks in passing tests", "",
                  "Ops that ran on the CPU fallback (no lowering, no decomposition) in passing tests, "
                  "by number of tests:", ""]
        lines.append(", ".join(f"`{op}` ({n})" for op, n in fallback_tests.most_common(40)))
        lines.append("")
    if skip_reasons:
        lines += ["## PyTorch's own skips, by reason", "", "| reason | tests |", "|---|---|"]
        for reason, n in skip_reasons.most_common(25):
            lines.append(f"| {reason.replace('|', '/')} | {n:,} |")
        lines.append("")
    lines += ["## Sources", "",
              "PyTorch's test files (BSD-3-Clause) as listed in the SOURCES.tsv beside them; the "
              "runner checks each file's git blob sha1 before running it.", "",
              "| file | upstream revision | blob sha1 | status |", "|---|---|---|---|"]
    for file in results:
        s = sources.get(file)
        if s and s["sha1"] != "-":
            lines.append(f"| {file} | {s['revision']} | `{s['sha1'][:12]}` | {s['status']} |")
        elif s:
            lines.append(f"| {file} | — | — | {s['status']} |")
        else:
            lines.append(f"| {file} | — | — | not available: {meta.get('missing', {}).get(file, 'not in the tests directory')} |")
    lines.append("")
    return "\n".join(lines)


def misclassified_skew(results: dict, cpu: dict, expectations: Expectations) -> list[tuple[str, str]]:
    """Tests the expectations call version skew that pass on CPU: a neuron problem after all."""
    wrong = []
    for file, recs in results.items():
        for tid, rec in recs.items():
            m = expectations.match(file, tid)
            if m and m[1]["class"] == "version-skew" and rec["status"] in FAILING \
                    and cpu.get(file, {}).get(tid, {}).get("status") == "passed":
                wrong.append((file, tid))
    return sorted(wrong)


# First guesses for --suggest, from the failure's message and the test's name: (class, reason,
# regex on "id: message"). A maintainer confirms each before it goes into the expectations file.
GUESSES = [
    ("not-supported-by-design", "sparse tensors are not supported on neuron", r"[Ss]parse|to_sparse|_csr|_coo"),
    ("not-supported-by-design", "quantized tensors are not supported on neuron", r"[Qq]uantized|quantize_per"),
    ("not-supported-by-design", "nested tensors are not supported on neuron", r"[Nn]ested"),
    ("not-supported-by-design", "forward-mode AD is not supported on neuron", r"forward_ad|fw_grad|make_dual|jvp"),
    ("not-supported-by-design", "the dtype is not supported on neuron (complex32, float8, uint16-64...)",
     r"is not supported on the neuron device"),
    ("known-bug", "issue 18: a CPU tensor where the op needs a neuron one (a device mismatch)",
     r"found at least two devices, neuron:0 and cpu"),
    ("known-bug", "issue 18: PyTorch's Python reference raises ValueError/IndexError/TypeError where CPU "
     "raises RuntimeError (check --cpu-check first: the file may fail on CPU too)", r"^[^:]*: (ValueError|IndexError): "),
    ("known-bug", "issue 18: an out=/in-place casting or argument check is missing",
     r"(out|_out_|casting|inplace|_).*RuntimeError not raised"),
    ("not-supported-by-design", "float64/complex128 run as float32/complex64 (TorchNeuron's dtype policy)",
     r"(float64|complex128|double).*(not close|not equal|dtype|do not match|mismatch)"),
]


def guess(tid: str, message: str) -> tuple[str, str]:
    text = f"{tid}: {message}"
    for cls, reason, pattern in GUESSES:
        if re.search(pattern, text):
            return cls, reason
    return "known-bug", "TODO (issue ?): " + message.replace('"', "'").replace("\\", "/")[:150]


def suggest(results, expectations, skew) -> str:
    """TOML lines for failures without an entry, with a first guess at their class."""
    out = []
    for file, recs in results.items():
        new = [(t, r) for t, r in sorted(recs.items())
               if r["status"] in FAILING and t != "<collection>" and not expectations.match(file, t)]
        if not new:
            continue
        out.append(f'\n["{file}"]')
        for t, r in new:
            if t in skew.get(file, ()):
                cls, reason = "version-skew", "fails on CPU too: " + r.get("message", "")[:120].replace('"', "'")
            else:
                cls, reason = guess(t, r.get("message", ""))
            if r["status"] in ("crashed", "timeout"):
                tail = f'action = "skip", cause = "{r["status"]}"'
            else:   # a first guess at the failure's text: the exception's name and its first words
                words = re.escape(r.get("message", "")[:60]).replace("\\", "\\\\").replace('"', '\\"')
                tail = f'match = "{words}"'
            out.append(f'"{t}" = {{ class = "{cls}", reason = "{reason}", {tail} }}')
    return "\n".join(out)


