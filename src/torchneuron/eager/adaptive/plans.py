"""What a recorded region's structure runs as: plans, their segments, and how a replayed call is
checked against a plan's op (``OpCheck``, built from the op's input specs, ``runtime/inputs.py``)."""

from __future__ import annotations

import collections

from ...config import config
from ...metrics import metrics
from ...ops.signature import OPT_TENSOR_LIST, TENSOR_LIST
from ...runtime import inputs
from ...runtime.inputs import is_view, views

_LISTS = (TENSOR_LIST, OPT_TENSOR_LIST)


class Segment:
    """Consecutive ops of a plan compiled as one fused executable."""

    __slots__ = ("ops", "start", "in_sids", "out_sids", "rt_start", "rt_stop", "carry", "fn", "checked", "state",
                 "error", "failures", "donated")

    def __init__(self, ops, start, in_sids, rt_start, rt_stop):
        self.ops = ops
        self.start = start          # the position of its first op in the plan
        self.in_sids = in_sids      # storages it reads that earlier segments or the caller provide
        self.out_sids = ()          # storages it produces that later segments read or that stay alive
        self.rt_start, self.rt_stop = rt_start, rt_stop
        self.carry = ()             # storages whose buffers are needed after it
        self.fn = None              # the fused executable, once compiled
        self.donated = ()           # positions of the inputs ``fn`` donates: storages it writes
        # Positions (in the segment) of the ops whose device-check outcomes ``fn`` returns after
        # the buffers of ``out_sids``, in op order: known once it was traced.
        self.checked = ()
        # None, "compiling", "ready", "bisecting" (isolate.py), or why it runs op by op for good:
        # "compile failed", "run failed", "differs" (its fused result differs from op by op).
        self.state = None
        self.error = None
        self.failures = 0           # fused runs that raised (then ran op by op)


class Plan:
    __slots__ = ("ops", "external_sids", "live", "device", "segments", "seen", "next", "checks", "direct",
                 "unsited")

    def __init__(self, structure, device):
        self.ops, self.external_sids, self.live = structure
        self.device = device
        self.seen = 0
        self.next = None            # the plan that followed this one last time (the prediction)
        self.segments = segments_of(self.ops, self.live, max(1, config.adaptive_segment_ops))
        if len(self.segments) > 1:
            metrics.region_splits += 1
        self.checks = [None] * len(self.ops)
        # Groups of ops isolated from fusion (isolate.py) whose call sites are still to be filled
        # in from the next occurrence: (their metrics.fusion_isolated entry, plan positions).
        self.unsited = []
        # The segment whose executable maps the region's inputs to its results, if it is the only one.
        seg = self.segments[0]
        self.direct = seg if len(self.segments) == 1 and seg.in_sids == self.external_sids \
            and seg.out_sids == self.live else None

    def check(self, pos):
        """How a call is checked against op ``pos`` when this plan is replayed (built on first use)."""
        check = self.checks[pos]
        if check is None:
            check = self.checks[pos] = OpCheck(self.ops[pos])
        return check


# Argument checks of a replayed op: a tensor view, a list of views, a list or a single argument of
# another kind (checked by Region._match).
VIEW, VIEW_LIST, SCALAR_LIST, LIST, OTHER = "view", "view list", "scalar list", "list", "other"


class OpCheck:
    """One plan op as the replay checks it: its executable key unpacked per argument, the storage
    ids each tensor must sit on, and what the op writes."""

    __slots__ = ("entry", "exe", "kernel", "statics", "args", "storages", "device", "default_dtype", "precision", "random",
                 "factory", "written", "maybe_checked", "aliased")

    def __init__(self, entry):
        exe, input_sids, _, _ = entry
        k, specs, statics, storages, device, default_dtype, precision = exe.key
        self.entry, self.exe, self.kernel = entry, exe, k
        self.precision = precision   # of a matmul or convolution: the replay checks the setting
        # (argument index, whether the key holds it frozen, its value in the key)
        self.statics = tuple((i, frozen, v) for (i, frozen), v in zip(k.statics, statics))
        self.storages, self.device, self.default_dtype = storages, device, default_dtype
        self.args = []
        # A view's offset in the key is 0 when it spans its whole storage ("whole": the call's view
        # must start there too), else None (the call's offset is a runtime input): see
        # runtime/inputs.py. A list of views is checked field by field over the whole list.
        D, SZ, ST, OFF, SL = inputs.DTYPE, inputs.SIZES, inputs.STRIDES, inputs.OFFSET, inputs.SLOT
        for (i, kind), spec in zip(k.inputs, specs):
            if kind in _LISTS:
                if spec and all(is_view(s) for s in spec):
                    whole = tuple(s[OFF] == 0 for s in spec)
                    sids = [input_sids[s[SL]] for s in spec]
                    self.args.append((VIEW_LIST, i, tuple(s[D] for s in spec), tuple(s[SZ] for s in spec),
                                      tuple(s[ST] for s in spec), True if all(whole) else whole,
                                      tuple(s[D].itemsize for s in spec), sids,
                                      [(*storages[s[SL]], device) for s in spec],
                                      sids == list(range(sids[0], sids[0] + len(sids)))))
                elif spec and all(t.__class__ is type for t in spec):
                    self.args.append((SCALAR_LIST, i, spec))
                else:
                    self.args.append((LIST, i, spec, input_sids))
            elif is_view(spec):
                slot = spec[SL]
                self.args.append((VIEW, i, spec, input_sids[slot], storages[slot]))
            else:
                self.args.append((OTHER, i, spec, input_sids))
        self.random = k.lowering.random
        # No tensor inputs: the device argument (else the current device) decides the key's device.
        self.factory = not reads_storage(specs)
        self.written = tuple(input_sids[slot] for slot in exe.writes)
        self.aliased = exe.aliased   # a written view shares its storage with another argument
        # Whether a replayed call keeps its call site for device-check errors (checks are known
        # once the executable was traced, which a plan's first run does).
        checks = exe.checks
        self.maybe_checked = checks is None or bool(checks)


def segments_of(ops, live, size):
    return split(ops, live, [(start, min(start + size, len(ops))) for start in range(0, len(ops), size)])


def split(ops, live, bounds, start=0, rt=0):
    """Segments of ``ops`` cut at ``bounds`` (consecutive (first, stop) positions covering them),
    with the storages each reads, produces for later and carries, given the storages ``live``
    after the last. ``start`` and ``rt`` place ``ops`` in their plan (its first op's position and
    runtime input); a segment's storage sets depend only on its own bounds, not on how the other
    ops are cut."""
    segments = []
    for first, stop in bounds:
        chunk = ops[first:stop]
        produced, reads = set(), {}
        n = 0
        for exe, input_sids, out_sids, n_runtime in chunk:
            for sid in input_sids:
                if sid not in produced:
                    reads.setdefault(sid, None)
            produced.update(sid for sid in out_sids if sid is not None)
            produced.update(input_sids[slot] for slot in exe.writes)
            n += n_runtime
        seg = Segment(chunk, start + first, tuple(reads), rt, rt + n)
        seg.carry = produced            # replaced below: what is needed after it
        segments.append(seg)
        rt += n
    needed = set(live)
    for seg in reversed(segments):
        produced = seg.carry
        seg.out_sids = tuple(sorted(produced & needed))
        seg.carry = tuple(sorted(needed))
        needed = (needed - produced) | set(seg.in_sids)
    return segments


table: dict = {}
starts: dict = {}                       # first executable of a plan -> the latest such plan
recent = collections.deque(maxlen=32)   # whether each of the latest flushes was a new plan
MAX_PLANS = 4096


def churning() -> bool:
    return len(recent) == recent.maxlen and sum(recent) >= recent.maxlen * 3 // 4


def interpret(ops, current, runtime, call):
    """Run recorded ops in order on the buffers in ``current`` (storage id -> buffer), in place.
    Returns [(op position, outcome)] of the ops with device checks (their executables' last result)."""
    position = 0
    found = []
    for n, (exe, input_sids, out_sids, n_runtime) in enumerate(ops):
        results = call(exe, [current[sid] for sid in input_sids], runtime[position:position + n_runtime])
        position += n_runtime
        k = 0
        for sid in out_sids:
            if sid is not None:
                current[sid] = results[k]
                k += 1
        for slot in exe.writes:
            current[input_sids[slot]] = results[k]
            k += 1
        if exe.checks:   # known once traced: by the call just made
            found.append((n, results[k]))
    return found


def reads_storage(specs) -> bool:
    return next(views(specs), None) is not None
