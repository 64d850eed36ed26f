"""Write ``docs/compatibility.md``: ``python -m tools.compatibility`` (``--check`` compares instead).

Two tables, from torchneuron's own records (nothing is run):

* every ATen operator overload of the pinned PyTorch (the dispatcher's ``aten::`` names) -> how
  eager mode runs it on neuron: a native kernel (lowered, a derived in-place/``out=`` variant, a
  metadata view, or written by hand), decomposed (by PyTorch above the backend, or by the fallback
  through ``torch._decomp``), or the CPU fallback; whether ``torch.compile`` graphs lower it; and the
  argument dtypes CPU's kernels refuse (refused on neuron too, with CPU's error), from
  ``ops.oprecord.records`` (``python -m torchneuron.where OP`` gives the files and lines);
* every public ``torch.cuda`` / ``torch.cuda.memory`` function -> its ``torch.neuron`` counterpart,
  and whether ``torchneuron.transfer_cuda()`` maps it.

The file starts with a fingerprint of what decided it; ``tests/test_compatibility.py`` regenerates
it and fails when the committed one is stale. Regenerate it after adding a lowering, an eager
kernel, a decomposition rule or a device function.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from collections import Counter

from .sweep import REPO

OUTPUT = REPO / "docs" / "compatibility.md"

NATIVE, DECOMPOSED_ABOVE, DECOMPOSED, FALLBACK = ("native", "decomposed (PyTorch)",
                                                   "decomposed (torch._decomp)", "CPU fallback")


def _registry_name(dispatcher_name: str) -> str:
    name = dispatcher_name.removeprefix("aten::")
    return name if "." in name else f"{name}.default"


def aten_ops() -> list[str]:
    """Every ``aten::`` overload of the dispatcher, registry spelling ("add.Tensor"), sorted."""
    import torch
    return sorted({_registry_name(n) for n in torch._C._dispatch_get_all_op_names() if n.startswith("aten::")})


_RNN = {"lstm.input", "gru.input", "rnn_tanh.input", "rnn_relu.input"}


def op_rows(platform: str) -> list[tuple[str, str, str, str, str]]:
    """(op, status, eager kernel, torch.compile, dtypes CPU refuses) per ATen overload."""
    import torch
    from torch._decomp import decomposition_table

    import torchneuron  # noqa: F401  (registers the device and every kernel)
    from torchneuron.eager import fallback
    from torchneuron.ops import cpu_dtypes, oprecord
    from torchneuron.ops.signature import aten_overload, is_composite_implicit

    records = oprecord.records(platform)
    rows = []
    for name in aten_ops():
        try:
            overload = aten_overload(name)
        except (AttributeError, RuntimeError):
            continue   # a dispatcher name Python's torch.ops.aten does not expose
        rec = records.get(name)
        kernel = rec.kernel if rec is not None else None
        dispatcher_name = f"aten::{name.removesuffix('.default')}"
        if kernel is None and torch._C._dispatch_has_kernel_for_dispatch_key(dispatcher_name, "PrivateUse1"):
            # Registered outside the op records: the fused RNN autograd kernels (eager/rnn.py).
            status, how = NATIVE, "by hand: rnn (fused autograd kernel)" if name in _RNN else "registered kernel"
        elif kernel is not None:
            status = NATIVE
            how = kernel if kernel in (oprecord.LOWERED, oprecord.INPLACE, oprecord.OUT, oprecord.METADATA,
                                       oprecord.RUNTIME_LR) else f"by hand: {kernel}"
        elif is_composite_implicit(overload):
            status, how = DECOMPOSED_ABOVE, "CompositeImplicitAutograd"
        elif dispatcher_name not in fallback.SKIP_DECOMPOSITION and \
                overload in decomposition_table:
            status, how = DECOMPOSED, "fallback runs the decomposition (counted)"
        else:
            status, how = FALLBACK, "CPU kernel, copies in and out (counted, warned once)"
        graph = (rec.graph_kind if rec is not None else None) or ""
        graph = "lowered" if graph == oprecord.OP else graph
        if not graph:
            graph = "AOTAutograd decomposes it" if status == DECOMPOSED_ABOVE or overload in decomposition_table \
                else "—"
        _, refused = cpu_dtypes.refusals_of(name, rec.functional if rec is not None else None)
        dtypes = ""
        if refused:
            codes = sorted({"/".join(map(str, sig)) for sig in refused})
            dtypes = ", ".join(codes[:4]) + (f" (+{len(codes) - 4})" if len(codes) > 4 else "")
        rows.append((name, status, how, graph, dtypes))
    return rows


def cuda_rows() -> list[tuple[str, str, str]]:
    """(torch.cuda name, its torch.neuron counterpart, transfer_cuda's mapping) per public function."""
    import types

    import torch

    from torchneuron.integrations import cuda as cuda_map

    mapped = set(cuda_map._CUDA_FUNCS) | {"is_available", "init", "Event", "Stream", "stream",
                                          "current_stream"}
    rows = []
    for module_name, names in (("torch.cuda", torch.cuda.__all__),
                               ("torch.cuda.memory", [*torch.cuda.memory.__all__, "_record_memory_history",
                                                      "_snapshot", "_dump_snapshot"])):
        module = torch.cuda if module_name == "torch.cuda" else torch.cuda.memory
        ours = torch.neuron if module_name == "torch.cuda" else torch.neuron.memory
        ours_name = "torch.neuron" if module_name == "torch.cuda" else "torch.neuron.memory"
        for name in sorted(set(names)):
            obj = getattr(module, name, None)
            if obj is None or isinstance(obj, types.ModuleType):
                continue
            has = hasattr(ours, name)
            neuron = f"`{ours_name}.{name}`" if has else "—"
            if module_name == "torch.cuda":
                by_map = "mapped" if name in mapped else ("mapped (torch.amp)" if name in ("amp",) else "")
            else:
                by_map = "mapped" if name in cuda_map._CUDA_MEMORY_FUNCS else ""
            if not has and not by_map:
                by_map = "CUDA's own (fails without CUDA)"
            rows.append((f"`{module_name}.{name}`", neuron, by_map))
    return rows


def _fingerprint(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def render(platform: str = "cpu") -> str:
    import torch

    ops = op_rows(platform)
    cuda = cuda_rows()
    counts = Counter(r[1] for r in ops)
    refused = sum(1 for r in ops if r[4])
    lines = [
        "# Compatibility: ATen operators and torch.cuda APIs on neuron",
        "",
        f"Generated by `python -m tools.compatibility` for torch {torch.__version__}, platform "
        f"`{platform}`; do not edit (`tests/test_compatibility.py` fails when it is stale).",
        "",
        "## ATen operators",
        "",
        f"{len(ops)} `aten::` overloads: " + ", ".join(f"{counts[k]} {k}" for k in
                                                       (NATIVE, DECOMPOSED_ABOVE, DECOMPOSED, FALLBACK)) +
        f"; {refused} refuse some argument dtypes as CPU's kernels do.",
        "",
        "- **native**: a PrivateUse1 kernel — *lowered* (its own JAX lowering, one cached executable), "
        "*in-place*/*out=* (derived from the functional op's lowering), *metadata* (a view: CPU's "
        "kernel builds sizes/strides on the neuron storage), or written *by hand* (`eager/`).",
        "- **decomposed (PyTorch)**: CompositeImplicitAutograd — PyTorch turns it into other ops above "
        "the backend, so it runs as those do.",
        "- **decomposed (torch._decomp)**: no kernel; the global fallback runs PyTorch's "
        "decomposition on neuron (counted in `metrics.decompositions`).",
        "- **CPU fallback**: no kernel and no decomposition; inputs are copied to the CPU, CPU's kernel "
        "runs, results are copied back (counted, warned once per op; `TORCHNEURON_FALLBACK=error` "
        "raises instead).",
        "- **torch.compile**: *lowered* (a graph node runs its lowering), *noop*/*sym*/*index_put* "
        "(special graph nodes), *AOTAutograd decomposes it* (graphs never hold it), — (a graph "
        "holding it fails to compile, or runs eagerly with `TORCHNEURON_COMPILE_FALLBACK=eager`).",
        "- **dtypes CPU refuses**: argument dtype signatures CPU's kernels reject "
        "(`src/torchneuron/ops/data/cpu_dtype_refusals.json`); neuron raises CPU's error for them.",
        "",
        "`python -m torchneuron.where OP` shows where each fact about one op is declared.",
        "",
        "| op | status | eager kernel | torch.compile | dtypes CPU refuses |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| `{n}` | {s} | {k} | {g} | {d} |" for n, s, k, g, d in ops]
    lines += [
        "",
        "## torch.cuda APIs",
        "",
        "Each public function of `torch.cuda` and `torch.cuda.memory`: the `torch.neuron` function of "
        "the same name, and whether `torchneuron.transfer_cuda()` (`TORCHNEURON_CUDA=neuron`, "
        "`torchneuron check --device-map cuda=neuron`) points the CUDA name at it. Streams are one "
        "ordered queue per device; `torch.neuron.memory` has no caching allocator of its own: reserved "
        "memory is PJRT's pool where the platform reports one (GPU), else allocated memory (CPU).",
        "",
        "| torch.cuda | torch.neuron | transfer_cuda() |",
        "|---|---|---|",
    ]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in cuda]
    body = "\n".join(lines) + "\n"
    return f"<!-- fingerprint {_fingerprint(body)} -->\n" + body


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default=str(OUTPUT))
    parser.add_argument("--check", action="store_true", help="exit 1 if the file is stale")
    parser.add_argument("--platform", default="cpu")
    args = parser.parse_args(argv)
    text = render(args.platform)
    if args.check:
        try:
            current = open(args.output).read()
        except FileNotFoundError:
            current = ""
        if current != text:
            print(f"{args.output} is stale: run python -m tools.compatibility", file=sys.stderr)
            return 1
        return 0
    with open(args.output, "w") as f:
        f.write(text)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
