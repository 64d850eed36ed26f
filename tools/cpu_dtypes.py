"""Measure which argument dtypes PyTorch's CPU kernels refuse: ``python -m tools.cpu_dtypes``.

Runs every sample of every OpInfo (``op_db`` and the Python references) in every dtype on CPU, forward
and, where the sample requires grad, backward (as OpInfo's ``test_dtypes`` does), under a dispatch
mode that records each ATen call's overload, argument dtypes (``ops.cpu_dtypes.dtype_signature``)
and outcome. An (overload, dtypes) pair goes into the table when every call of it failed with one
dtype error and the overload ran for other dtypes: a dtype refusal, not a bad sample; unless the
dtype is float16/bfloat16 and the OpInfo lists it for CUDA (a gap in CPU's kernels, such as
float16 special functions, which an accelerator is expected to fill). The table is
written to ``src/torchneuron/ops/data/cpu_dtype_refusals.json`` (package data; eager kernels
consult it when they plan an executable, ``ops.cpu_dtypes.load_table`` reads it). Every tensor is a CPU tensor.

Takes ~15 minutes on 2 cores; rerun it when the pinned torch changes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import warnings
from collections import defaultdict
from pathlib import Path

from .sweep import REPO

OUTPUT = REPO / "src" / "torchneuron" / "ops" / "data" / "cpu_dtype_refusals.json"

# A refusal's message names a dtype (ATen's dispatch macros: "\"abs_cpu\" not implemented for
# 'Bool'"; explicit checks: "std and var only support floating point and complex dtypes").
DTYPE_WORDS = re.compile(
    r"not implemented for '|\b(Bool|Byte|Char|Short|Int|Long|Half|BFloat16|Float|Double|ComplexFloat|"
    r"ComplexDouble|dtype|dtypes|floating|integral|integer|complex|boolean)\b", re.I)
# Errors that are not about the kernel's dtypes: missing kernels, casting into out=/in-place results,
# value checks that mention a dtype word in passing.
NOT_A_REFUSAL = re.compile(
    r"^Could not run|can't be cast to the desired output|result type .* can't be cast|"
    r"Expected all tensors to be on the same device|out of (range|bounds)|must be (non-?negative|positive)|"
    r"shape|size|dimension|Trying to resize|negative", re.I)


def _message(err: BaseException) -> str:
    return str(err)


def _flat(signature) -> set:
    """The dtype codes in a dtype signature (lists of tensors flattened)."""
    out = set()
    for c in signature:
        out.update(_flat(c) if isinstance(c, tuple) else (c,))
    return out


class Recorder:
    """(overload name, dtype signature) -> {"ok": calls that ran, "errors": {(type, message): n}}."""

    def __init__(self):
        self.calls = defaultdict(lambda: {"ok": 0, "errors": defaultdict(int)})
        # Calls that failed on CPU in float16/bfloat16 where the OpInfo says CUDA supports them: a gap
        # in CPU's kernels (float16 special functions, bfloat16 avg_pool3d...), which an accelerator
        # is expected to fill.
        self.device_supported = set()
        self.cuda_ok = None        # "f16"/"bf16" while running a half dtype CUDA supports
        self.ran = set()           # overloads that ran at least once
        self._sigs = {}

    def signature(self, func):
        from torchneuron.ops.signature import OpSignature  # the tool imports torch lazily (--help)
        sig = self._sigs.get(func)
        if sig is None:
            sig = self._sigs[func] = OpSignature(func, None)
        return sig

    def mode(self):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        # The tool imports torch lazily (--help, TORCH_DEVICE_BACKEND_AUTOLOAD set first).
        from torchneuron.ops.cpu_dtypes import dtype_signature, has_empty_tensor
        from torchneuron.ops.signature import registry_name
        recorder = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                key, name = (), None
                if isinstance(func, torch._ops.OpOverload) and func.namespace == "aten":
                    try:
                        sig = recorder.signature(func)
                        values = sig.bind(args, kwargs)
                        name = registry_name(func)
                        # Kernels often return before dispatching on the dtype when a tensor is
                        # empty: such calls say nothing about the dtype (nor does the check).
                        if not has_empty_tensor(sig, values):
                            key = {(name, dtype_signature(sig, values)), (name, dtype_signature(sig, values, True))}
                    except Exception:  # noqa: BLE001 - an odd schema: not recorded
                        key, name = (), None
                try:
                    out = func(*args, **kwargs)
                except Exception as err:
                    for k in key:
                        recorder.calls[k]["errors"][(type(err).__name__, _message(err))] += 1
                        # Only calls in the half dtype under test (a float16 sample's bool mask
                        # passed to abs is still CPU's bool refusal).
                        if recorder.cuda_ok and recorder.cuda_ok in _flat(k[1]):
                            recorder.device_supported.add(k)
                    raise
                if name is not None:
                    recorder.ran.add(name)
                for k in key:
                    recorder.calls[k]["ok"] += 1
                return out

        return Mode()


def _run_samples(recorder, ops, dtypes, max_samples, log):
    import torch
    from torch.testing._internal.common_dtype import floating_and_complex_types_and
    backward_dtypes = set(floating_and_complex_types_and(torch.half, torch.bfloat16))
    half = {torch.float16: "f16", torch.bfloat16: "bf16"}
    for n, op in enumerate(ops):
        if op.name.startswith(("sparse", "to_sparse")) or "sparse" in op.variant_test_name:
            continue
        cuda = set(op.supported_dtypes("cuda"))
        for dtype in dtypes:
            requires_grad = op.supports_autograd and dtype in backward_dtypes
            # Only the half-precision gaps: bool, integer and complex refusals stay CPU's even where
            # CUDA's kernels take them (abs of bool), as PyTorch's tests hold neuron to CPU's lists.
            recorder.cuda_ok = half.get(dtype) if dtype in cuda else None
            try:
                samples = list(op.sample_inputs("cpu", dtype, requires_grad=requires_grad))[:max_samples]
            except Exception:  # noqa: BLE001 - no samples for this dtype: nothing ran
                continue
            for sample in samples:
                with recorder.mode():
                    try:
                        result = op(sample.input, *sample.args, **sample.kwargs)
                    except Exception:  # noqa: BLE001 - recorded by the mode
                        continue
                    try:
                        result = sample.output_process_fn_grad(result)
                        t = result if isinstance(result, torch.Tensor) else \
                            result[0] if isinstance(result, list | tuple) and result and \
                            isinstance(result[0], torch.Tensor) else None
                        if t is not None and t.requires_grad:
                            t.backward(torch.randn_like(t))
                    except Exception:  # noqa: BLE001 - recorded by the mode
                        pass
        if n % 50 == 0:
            log(f"  {n}/{len(ops)} {op.full_name if hasattr(op, 'full_name') else op.name}")


def refusals(calls, ran, device_supported=frozenset()) -> dict:
    """The table: overload -> {dtype signature: (exception type, message)}; every overload seen
    appears (with {} when CPU refused none of its calls). Refusals met in float16/bfloat16 where the
    OpInfo lists them for CUDA are left out: neuron, like CUDA, runs them (bfloat16 avg_pool3d)."""
    table = {name: {} for name in ran}
    for key, rec in calls.items():
        name, dtypes = key
        if rec["ok"] or not rec["errors"] or name not in ran or key in device_supported:
            continue
        errors = rec["errors"]
        kinds = {kind for kind, _ in errors}
        # One error, or only the dispatch macros' ("softmax_kernel_impl" and
        # "softmax_lastdim_kernel_impl" not implemented for 'Long': one kernel per layout).
        if len(errors) > 1 and not (kinds == {"NotImplementedError"}
                                    and all("not implemented for '" in m for _, m in errors)):
            continue
        (kind, message), _ = max(errors.items(), key=lambda e: e[1])
        if kind not in ("NotImplementedError", "RuntimeError") or not DTYPE_WORDS.search(message) \
                or NOT_A_REFUSAL.search(message):
            continue
        table[name][dtypes] = (kind, message)
    return table


def write_table(table: dict, path: Path, torch_version: str) -> None:
    """``table`` as JSON (``ops.cpu_dtypes.load_table`` reads it back), one refusal a line, sorted:
    ``{"torch_version": ..., "refusals": {overload: [[dtype signature, exception type, message]]}}``."""
    lines = ["{", f' "torch_version": {json.dumps(torch_version)},',
             f' "generated_by": "python -m tools.cpu_dtypes ({len(table)} overloads seen, '
             f'{sum(len(v) for v in table.values())} refused dtype signatures); do not edit, regenerate",',
             ' "refusals": {']
    names = sorted(table)
    for n, name in enumerate(names):
        entries = sorted(json.dumps([list_of(sig), kind, message]) for sig, (kind, message) in table[name].items())
        comma = "," if n < len(names) - 1 else ""
        if not entries:
            lines.append(f"  {json.dumps(name)}: []{comma}")
            continue
        lines.append(f"  {json.dumps(name)}: [")
        lines.extend(f"   {e}{',' if i < len(entries) - 1 else ''}" for i, e in enumerate(entries))
        lines.append(f"  ]{comma}")
    lines += [" }", "}"]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def list_of(signature) -> list:
    """A dtype signature (nested tuples) as JSON lists."""
    return [list_of(c) if isinstance(c, tuple) else c for c in signature]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.cpu_dtypes", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", default=str(OUTPUT))
    p.add_argument("--ops", help="comma-separated OpInfo names (default: all)")
    p.add_argument("--max-samples", type=int, default=24, help="samples per op and dtype")
    args = p.parse_args(argv)
    os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"   # CPU PyTorch only
    warnings.simplefilter("ignore")
    import torch
    from torch.testing._internal.common_methods_invocations import op_db, python_ref_db
    ops = list(op_db) + list(python_ref_db)
    if args.ops:
        wanted = set(args.ops.split(","))
        ops = [o for o in ops if o.name in wanted or getattr(o, "full_name", o.name) in wanted]
    dtypes = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
              torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128]
    recorder = Recorder()
    t0 = time.time()
    _run_samples(recorder, ops, dtypes, args.max_samples, lambda m: print(m, file=sys.stderr, flush=True))
    table = refusals(recorder.calls, recorder.ran, recorder.device_supported)
    write_table(table, Path(args.output), torch.__version__)
    print(f"{len(table)} overloads seen, {sum(len(v) for v in table.values())} refused dtype signatures, "
          f"{time.time() - t0:.0f} s -> {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
