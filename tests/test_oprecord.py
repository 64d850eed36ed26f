"""One record per op (ops/oprecord.py): registration is a loop over the records, every fact about an
op is reachable from its record, and ``python -m torchneuron.where`` says where each one lives."""

import ast
import os
import subprocess
import sys

import pytest
import torch

import torchneuron
from torchneuron import where
from torchneuron.config import config
from torchneuron.eager import registration
from torchneuron.eager.kernel import Kernel
from torchneuron.eager.out_variants import OutKernel
from torchneuron.ops import oprecord, registry
from torchneuron.ops.signature import aten_overload

_SRC = os.path.dirname(os.path.dirname(os.path.abspath(torchneuron.__file__)))


def _records():
    return oprecord.records(config.platform)


def _source_line(location: str) -> str:
    file, line = location.rsplit(":", 1)
    with open(os.path.join(_SRC, file)) as f:
        return f.read().splitlines()[int(line) - 1]


def test_registered_kernels_are_the_records_kernels():
    recs = _records()
    assert set(registration.KERNELS) == {n for n, r in recs.items() if r.kernel is not None}
    for name, kernel in registration.KERNELS.items():
        rec = recs[name]
        if rec.wrappers or rec.kernel in (oprecord.METADATA, oprecord.RUNTIME_LR):
            assert callable(kernel) and not isinstance(kernel, Kernel | OutKernel), name
        elif rec.kernel in (oprecord.LOWERED, oprecord.INPLACE):
            assert type(kernel) is Kernel and kernel.overload is aten_overload(name), name
            expected = rec.lowering if rec.kernel == oprecord.LOWERED else registry.get(rec.functional)
            assert kernel.lowering is expected, name
        elif rec.kernel == oprecord.OUT:
            # Around the functional op's Kernel (the one its lowering gives, unwrapped).
            assert type(kernel) is OutKernel and type(kernel.functional) is Kernel, name
            assert kernel.functional.overload is aten_overload(rec.functional), name
        else:
            assert kernel is registration.hand_written(rec.kernel), name


def test_special_cases_are_wrapped_as_before():
    k = registration.KERNELS
    assert k["index.Tensor"].__qualname__ == "make_index.<locals>.index"
    assert k["index_put_.default"].__qualname__ == "make_index_put.<locals>.index_put"
    assert k["linalg_inv_ex.inverse"].__qualname__ == "make_check_errors.<locals>.checked"
    assert k["mm.default"].__qualname__ == "_resolving_math_bits.<locals>.resolved"
    assert k["copy_.default"].__qualname__ == "_copy_with_math_bits.<locals>.copy_"
    assert k["view.default"].__qualname__ == "_redispatch_cpu.<locals>.kernel"
    assert k["nonzero.default"] is registration.hand_written("host_ops.nonzero")
    # The hand-written copy_ copies between neuron tensors through the lowering's kernel.
    assert type(registration.storage_ops.device_copy_kernel) is Kernel
    assert registration.storage_ops.device_copy_kernel.overload is torch.ops.aten.copy_.default


def test_declared_names_are_aten_overloads_and_kernels_exist():
    for name, policy in oprecord.EAGER.items():
        aten_overload(name)
        if policy.kernel not in (None, oprecord.METADATA, oprecord.RUNTIME_LR):
            assert callable(registration.hand_written(policy.kernel)), name
        for other in (policy.via, policy.masked_fill):
            assert other is None or other in registration.KERNELS, (name, other)
    for name in oprecord.GRAPH_KINDS:
        aten_overload(name)


def test_every_lowering_is_findable_by_its_full_name():
    """Lowerings registered in loops (exp.default) too: the record knows the line that registered it."""
    recs = _records()
    for name in registry.LOWERINGS:
        file, line = recs[name].site
        assert os.path.abspath(file).startswith(os.path.join(_SRC, "torchneuron", "ops") + os.sep), name
        text = _source_line(f"{os.path.relpath(file, _SRC)}:{line}")
        assert "lowering(" in text or "add(" in text, (name, text)
    exp = recs["exp.default"]
    assert '"exp.default"' not in open(exp.site[0]).read()   # registered in a loop over names


@pytest.mark.parametrize("name", ["add.Tensor", "index.Tensor", "exp.default", "view.default"])
def test_where_names_the_line_that_registers_the_lowering(name):
    facts = where.facts(name)
    loc = facts["lowering"].split("registered at ", 1)[1].split(",")[0].split()[0]
    assert loc.startswith("torchneuron/ops/")
    text = _source_line(loc)
    assert "lowering(" in text
    if name in ("add.Tensor", "index.Tensor", "view.default"):   # decorated: the name is spelled there
        assert f'"{name}"' in text


def test_where_facts_of_special_cases():
    index = where.facts("index.Tensor")
    assert "host_indices" in index["eager policy"] and "CPU" in index["device index"]
    assert _source_line(index["eager policy"].split(";")[0]).strip().startswith('"index.Tensor"')
    add = where.facts("add.Tensor")
    assert add["eager kernel"].startswith("lowered: torchneuron/eager/kernel.py:")
    assert "add_.Tensor" in add["derived variants"] and "add.out" in add["derived variants"]
    assert add["graph kind"] == "op"
    nonzero = where.facts("nonzero.default")
    assert nonzero["lowering"] == "none"
    assert _source_line(nonzero["eager kernel"].rsplit(": ", 1)[1]).startswith("def nonzero(")
    view = where.facts("view.default")
    assert view["eager kernel"].startswith("metadata:") and "graph_only=True" in view["lowering"]
    index_add = where.facts("index_add_.default")
    assert index_add["derived from"].startswith("index_add.default")
    assert "'index' must be on the op's device" in index_add["device index"]
    assert where.facts("sym_size.int")["graph kind"].startswith("sym (torchneuron/ops/oprecord.py:")
    assert "i64" in where.facts("gelu.default")["dtype refusals"]
    assert "out= shape" in where.facts("arange.out") and "out= dtype" in where.facts("sum.IntList_out")
    assert "skips its decomposition" in where.facts("lift_fresh.default")["eager kernel"]


def test_where_runs_as_a_module():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([_SRC, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "torchneuron.where", "add.Tensor", "nonzero.default"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "aten::add.Tensor" in done.stdout and "host_ops.nonzero" in done.stdout


def test_registration_names_no_op_of_its_own():
    """An eager special case is declared in ops/oprecord.py's EAGER, not as an override in
    registration.py: the only op names there are the kernels its helpers call."""
    tree = ast.parse(open(registration.__file__).read())
    names = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
             and n.value.count(".") == 1 and " " not in n.value and n.value.split(".")[1][:1].isalpha()}
    names = {n for n in names if n in registry.LOWERINGS or n in oprecord.EAGER}
    assert names <= {"copy_.default", "_conj_physical.default", "neg.default"}, names


def test_where_takes_an_op_name_without_its_default_overload():
    # `where exp` is aten::exp's only overload; `where add` names the overloads to choose from.
    assert where.facts("exp")["lowering"] == where.facts("exp.default")["lowering"] != "none"
    with pytest.raises(SystemExit, match="add.Tensor"):
        where.facts("add")
