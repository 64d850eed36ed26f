"""Isolating the ops a fused region cannot hold.

A segment's fused executable may fail to compile, fail when it runs, or give other values than the
same ops run one by one through plain eager's executables (``config.adaptive_verify_fusion``
compares them when a segment is compiled: a field report had a 32-bit overflow inside a fused group
that no single op showed). Then the segment is bisected, on the background compiler's thread, to the
smallest group of consecutive ops that still fails: that group runs op by op from then on, the ops
around it are fused again, and ``metrics.fusion_isolated`` names the group's ops (and, from the
plan's next occurrence, their call sites) for the report.

Every probe runs on the sample the segment was compiled with: the buffers before a probed group are
those the ops before it produce one by one, so each group is judged on its own inputs.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from ...metrics import metrics
from ...runtime import donation, sites
from . import plans

# Most fused compiles one bisection may spend (each probe is one): past it, what is left unresolved
# runs op by op, named as one group. A compiler that fails every region (the worst case) costs about
# one probe per op.
MAX_PROBES = 48

RAISED = ("compile failed", "run failed")


def _reference_op(exe, bufs, runtime):
    """One op through its per-op executable, as plain eager runs it (not counted in metrics)."""
    call = exe.call
    if call is None:   # not run alone yet in this process: compiled for this probe only
        call = jax.jit(exe.traced)
    else:              # the probe keeps the buffers before each op: the op must not donate them
        bufs = donation.keep_inputs(exe, bufs, exe.key[4])
    return call(*bufs, *runtime)


class Reference:
    """A segment's ops run one by one on a sample: the storages' buffers before each op, and the
    outcome of each checked op's device checks."""

    def __init__(self, seg, sample):
        n_in = len(seg.in_sids)
        self.seg = seg
        self.runtime = list(sample[n_in:])
        self.states = [dict(zip(seg.in_sids, sample[:n_in]))]
        self.rt_at = [0]             # runtime position of each op
        self.outcomes = {}           # op position in the segment -> its device checks' outcome

    def before(self, i):
        """The buffers before op ``i`` (``len(ops)``: after the last), running the ops up to it."""
        ops = self.seg.ops
        while len(self.states) <= i:
            j = len(self.states) - 1
            n_runtime = ops[j][3]
            current = dict(self.states[j])
            at = self.rt_at[j]
            found = plans.interpret([ops[j]], current, self.runtime[at:at + n_runtime], _reference_op)
            if found:
                self.outcomes[j] = found[0][1]
            self.states.append(current)
            self.rt_at.append(at + n_runtime)
        return self.states[i]


def _mismatch(fused, reference) -> str | None:
    """How a fused result differs from the op-by-op one, or None when they agree."""
    a, b = np.asarray(fused), np.asarray(reference)
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"{a.dtype}{list(a.shape)} against {b.dtype}{list(b.shape)} one by one"
    if a.dtype.kind in "fc" or a.dtype.name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        # Fusion may reorder a reduction or contract a multiply-add: ulps, not a wrong value.
        rtol, atol = (1e-2, 1e-3) if a.dtype.itemsize <= 2 else (1e-4, 1e-6)
        wide = np.complex128 if a.dtype.kind == "c" else np.float64
        a, b = a.astype(wide), b.astype(wide)
        if np.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True):
            return None
        worst = int(np.nanargmax(np.abs(a - b).reshape(-1))) if a.size else 0
        return f"{a.reshape(-1)[worst]} against {b.reshape(-1)[worst]} one by one (element {worst})"
    if np.array_equal(a, b):
        return None
    worst = int(np.argmax((a != b).reshape(-1)))
    return f"{a.reshape(-1)[worst]} against {b.reshape(-1)[worst]} one by one (element {worst})"


def difference(seg, results, ref, first=0):
    """What differs between ``results`` of a fused group of ``seg`` starting at op ``first`` (its
    ``out_sids`` buffers, then its checked ops' outcomes) and the same ops run one by one, or None."""
    after = ref.before(first + len(seg.ops))
    for sid, value in zip(seg.out_sids, results):
        found = _mismatch(value, after[sid])
        if found is not None:
            return f"the result of {_producer(seg, sid)} is {found}"
    for n, outcome in zip(seg.checked, results[len(seg.out_sids):]):
        found = _mismatch(outcome, ref.outcomes.get(first + n))
        if found is not None:
            return f"the device checks of {seg.ops[n][0].name} gave {found}"
    return None


def _producer(seg, sid) -> str:
    """The op of ``seg`` that last produced or wrote storage ``sid``."""
    for exe, input_sids, out_sids, _ in reversed(seg.ops):
        if sid in out_sids or any(input_sids[slot] == sid for slot in exe.writes):
            return exe.name
    return "an op"


class Bisection:
    """Probes groups of a segment's ops, fused, against the reference, to isolate failing ones."""

    def __init__(self, plan, seg, device, sample, trigger, fuse, verify):
        self.plan, self.seg, self.device, self.fuse, self.verify = plan, seg, device, fuse, verify
        self.trigger = trigger        # (reason, error text) that started it
        self.ref = Reference(seg, sample)
        self.probes = {}              # (first, stop) -> (segment, failure or None)
        self.left = MAX_PROBES

    def probe(self, first, stop):
        """Compile and run ops [first, stop) fused; (its segment, None) or (segment, (reason, error))."""
        found = self.probes.get((first, stop))
        if found is not None:
            return found
        seg, n = self.seg, len(self.seg.ops)
        bounds = [b for b in ((0, first), (first, stop), (stop, n)) if b[1] > b[0]]
        sub = next(s for s in plans.split(seg.ops, seg.carry, bounds, seg.start, seg.rt_start)
                   if s.start == seg.start + first)
        if self.left <= 0:
            found = (sub, (self.trigger[0], "not bisected further: probe limit reached"))
        else:
            self.left -= 1
            before = self.ref.before(first)
            rt = self.ref.runtime[sub.rt_start - seg.rt_start:sub.rt_stop - seg.rt_start]
            failure = None
            try:
                sub.fn = self.fuse(sub, self.device)
                results = sub.fn(*[before[sid] for sid in sub.in_sids], *rt)
            except Exception as err:   # noqa: BLE001 - what fails is the finding
                sub.fn = None
                reason = self.trigger[0] if self.trigger[0] in RAISED else "compile failed"
                failure = (reason, f"{type(err).__name__}: {err}".splitlines()[0][:500])
            else:
                if self.verify:
                    diff = difference(sub, results, self.ref, first)
                    if diff is not None:
                        sub.fn = None
                        failure = ("differs", diff)
            found = (sub, failure)
        self.probes[(first, stop)] = found
        return found

    def pieces(self, first, stop):
        """[(first, stop, failure or None)] covering [first, stop): fused groups and the smallest
        failing groups between them."""
        if stop <= first:
            return []
        _, failure = self.probe(first, stop)
        if failure is None or stop - first == 1:
            return [(first, stop, failure)]
        # The shortest failing prefix, then the shortest failing suffix of it: a smallest window.
        lo, hi = first + 1, stop
        while lo < hi:
            mid = (lo + hi) // 2
            if self.probe(first, mid)[1] is not None:
                hi = mid
            else:
                lo = mid + 1
        end = hi
        lo, hi = first, end - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.probe(mid, end)[1] is not None:
                lo = mid
            else:
                hi = mid - 1
        start = lo
        return self.pieces(first, start) + [(start, end, self.probe(start, end)[1])] + self.pieces(end, stop)

    def run(self):
        """Bisect, then put the new segments in the plan in place of the old one."""
        seg = self.seg
        found = self.pieces(0, len(seg.ops))
        merged = []   # adjacent failing groups of one reason run op by op as one segment
        for first, stop, failure in found:
            if merged and failure is not None and merged[-1][2] is not None and merged[-1][2][0] == failure[0]:
                merged[-1] = (merged[-1][0], stop, merged[-1][2])
            else:
                merged.append((first, stop, failure))
        subs = plans.split(seg.ops, seg.carry, [(a, b) for a, b, _ in merged], seg.start, seg.rt_start)
        for sub, (first, stop, failure) in zip(subs, merged):
            if failure is None:
                probed = self.probes.get((first, stop), (None,))[0]
                if probed is not None and probed.fn is not None and probed.in_sids == sub.in_sids \
                        and probed.out_sids == sub.out_sids:
                    sub.fn, sub.checked, sub.state = probed.fn, probed.checked, "ready"
                    metrics.region_compiles += 1
                continue
            sub.state, sub.error = failure
            self._name(sub, failure)
        segments = list(self.plan.segments)
        i = next(i for i, s in enumerate(segments) if s is seg)
        # One list assignment: a run of the plan on the user's thread sees the old or the new list.
        self.plan.segments = segments[:i] + subs + segments[i + 1:]
        self.plan.direct = None
        return subs

    def _name(self, sub, failure):
        entry = {"ops": [exe.name for exe, *_ in sub.ops], "sites": [None] * len(sub.ops),
                 "reason": failure[0], "error": failure[1], "region_ops": len(self.plan.ops),
                 "first": sub.start}
        metrics.fusion_isolated.append(entry)
        self.plan.unsited.append((entry, range(sub.start, sub.start + len(sub.ops))))


def bisect(plan, seg, device, sample, trigger, fuse, verify) -> float:
    """Isolate the failing groups of ``seg`` (see the module's text); the seconds it took."""
    start = time.perf_counter()
    seg.state = "bisecting"
    Bisection(plan, seg, device, sample, trigger, fuse, verify).run()
    return time.perf_counter() - start


def name_sites(plan, op_sites) -> None:
    """On the user's thread, after an occurrence of ``plan`` ran: fill in the call sites of its
    isolated groups from that occurrence's sites and warn once per group; an op whose site was not
    kept (its replay keeps sites of checked ops only) keeps it from the next occurrence on."""
    still = []
    for entry, positions in plan.unsited:
        where = [op_sites.get(p) for p in positions]
        if None in where and not entry.get("asked"):
            entry["asked"] = True
            for p in positions:
                plan.check(p).maybe_checked = True
            still.append((entry, positions))
            continue
        entry.pop("asked", None)
        entry["sites"] = [sites.describe_place(w) for w in where]
        shown = next((s for s in entry["sites"] if s is not None), None)
        ops = ", ".join(entry["ops"][:8]) + (", ..." if len(entry["ops"]) > 8 else "")
        sites.warn(f"torchneuron: adaptive eager: a fused group of {len(entry['ops'])} op(s) ({ops}) "
                   f"{_WHAT[entry['reason']]} ({entry['error']}); these ops run one by one from now on, "
                   f"the rest of the region stays fused. First op at {sites.format_site(shown)}. "
                   "metrics()['fusion_isolated'] lists every such group.")
    plan.unsited = still


_WHAT = {"compile failed": "failed to compile", "run failed": "failed when it ran",
         "differs": "gave other values than its ops run one by one"}
