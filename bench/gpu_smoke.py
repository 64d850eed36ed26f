"""Smoke run for a GPU machine: the neuron device on JAX's CUDA client, side by side with torch CUDA.

Plain Python with whatever packages the machine has (no installs, no network); finishes in a few
minutes. Each section is guarded: a failure is printed and recorded, and the next section runs.

    PYTHONPATH=src python bench/gpu_smoke.py [--out results.json]
    TORCHNEURON_PLATFORM=cpu PYTHONPATH=src python bench/gpu_smoke.py   # the same sections on CPU

Sections (docs/gpu.md says what each measures):
  facts     versions, JAX devices and PJRT platform version, torch.neuron device count
  parity    one training step (forward, backward, SGD) of a small GPT and a small conv net: neuron
            against the reference (torch CUDA when it is there, else torch CPU), same weights/inputs
  overhead  eager per-op cost in microseconds (N back-to-back calls, then a sync), neuron vs reference
  compiled  forward of the small GPT through torch.compile(backend="neuron") vs reference eager
            (and vs Inductor when the reference is CUDA)
  memory    peak memory of one GPT training step: torch.neuron's statistics, PJRT's own, torch CUDA's
  parity_hf one training step of a tiny random Hugging Face Llama (transformers), as parity_gpt
  compiled_train  the GPT's training step (forward, backward, AdamW) through torch.compile: neuron vs
            reference eager and Inductor, ms per step and the loss of each
  collectives  torchrun ranks (two where there are two GPUs, else one: NCCL refuses two ranks on
            one GPU) run all_reduce / all_gather / reduce_scatter / broadcast on neuron tensors with
            TORCHNEURON_COLLECTIVES=shared: NCCL on CUDA (gloo on the CPU platform)
  tests     the device-module, memory, cache and kernel test modules under pytest on this platform
            (at most TESTS_BUDGET_S seconds): counts and the names of the failures

The reference is CPU on a machine without CUDA: numbers from such a run are a sanity check of the
script, not GPU figures.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform as host_platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

# The platform and the GPU allocator are read when the neuron device starts; torch CUDA shares the
# GPU with JAX here, so JAX's allocator grows on demand instead of reserving 75% of the memory.
os.environ.setdefault("TORCHNEURON_PLATFORM", "cuda")
os.environ.setdefault("TORCHNEURON_GPU_PREALLOCATE", "0")
# A fresh executable cache: compile times are cold ones, and nothing stored by another version loads.
os.environ.setdefault("TORCHNEURON_CACHE_DIR", tempfile.mkdtemp(prefix="torchneuron-smoke-"))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

RESULTS: dict = {"sections": {}}
NEURON_ERROR = None
try:
    import torchneuron  # noqa: F401  (registers the neuron device)
except Exception as err:  # noqa: BLE001 - recorded: the other sections still run
    NEURON_ERROR = f"{type(err).__name__}: {err}"


SECTIONS: list = []


def section(name):
    """Register the decorated function as a section (run in order by ``main``)."""
    def register(fn):
        SECTIONS.append((name, fn))
        return fn
    return register


def run_section(name, fn) -> None:
    """Run one section, guarded: its result or its error is recorded."""
    print(f"\n== {name}", flush=True)
    start = time.perf_counter()
    entry = {}
    try:
        entry["result"] = fn()
        entry["ok"] = True
    except Exception as err:  # noqa: BLE001 - one failing section must not stop the others
        entry["ok"] = False
        entry["error"] = f"{type(err).__name__}: {err}"
        entry["traceback"] = traceback.format_exc()[-3000:]
        print(f"FAILED: {entry['error']}\n{entry['traceback']}", flush=True)
    entry["seconds"] = round(time.perf_counter() - start, 2)
    print(f"-- {name}: {'ok' if entry['ok'] else 'FAILED'} ({entry['seconds']} s)", flush=True)
    RESULTS["sections"][name] = entry


def need_neuron():
    if NEURON_ERROR is not None:
        raise RuntimeError(f"torchneuron did not import: {NEURON_ERROR}")


def reference_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def sync(device: str) -> None:
    if device.startswith("neuron"):
        torch.neuron.synchronize()
    elif device.startswith("cuda"):
        torch.cuda.synchronize()


# -- models -----------------------------------------------------------------------------------------

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from compile_gpt import GPT  # noqa: E402  - the flagship example's model


class ConvNet(nn.Module):
    def __init__(self, classes=10):
        super().__init__()
        self.features = nn.Sequential(
            # No conv bias before BatchNorm: its gradient is zero up to rounding, so any relative
            # comparison of it measures noise.
            nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1))
        self.head = nn.Linear(32, classes)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


def gpt_batch(batch=4, length=32, vocab=256):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (batch, length + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def conv_batch(batch=8):
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch, 3, 32, 32, generator=g), torch.randint(0, 10, (batch,), generator=g)


def train_step(model, inputs, targets, device):
    """One SGD step on ``device``: (loss, {name: grad}, {name: param after the step}) on the CPU."""
    model = copy.deepcopy(model).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    inputs, targets = inputs.to(device), targets.to(device)
    logits = model(inputs)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    loss.backward()
    grads = {n: p.grad.detach().cpu() for n, p in model.named_parameters()}
    opt.step()
    sync(device)
    return (float(loss.detach().cpu()), grads,
            {n: p.detach().cpu() for n, p in model.named_parameters()})


def max_relative_diff(a: dict, b: dict) -> tuple[float, str]:
    """The largest difference of a tensor relative to its largest value, and the tensor's name."""
    worst, where = 0.0, ""
    for name in a:
        scale = max(float(b[name].abs().max()), 1e-6)
        diff = float((a[name] - b[name]).abs().max()) / scale
        if diff >= worst:
            worst, where = diff, name
    return worst, where


# -- sections ---------------------------------------------------------------------------------------

@section("facts")
def facts():
    import jax
    found = {"python": sys.version.split()[0], "host": host_platform.platform(), "torch": torch.__version__,
             "torch_cuda": torch.version.cuda, "torch_cuda_available": torch.cuda.is_available(),
             "jax": jax.__version__, "reference": reference_device(),
             "TORCHNEURON_PLATFORM": os.environ.get("TORCHNEURON_PLATFORM"),
             "torchneuron_import_error": NEURON_ERROR}
    if torch.cuda.is_available():
        found["torch_cuda_device"] = torch.cuda.get_device_name(0)
        found["torch_cuda_device_count"] = torch.cuda.device_count()
    if NEURON_ERROR is None:
        found["torchneuron"] = torchneuron.__version__
        found["neuron_device_count"] = torch.neuron.device_count()
        from torchneuron.runtime import pjrt
        found["neuron_platform"] = torchneuron.config.platform
        found["pjrt_platform_version"] = pjrt.platform_version()
        found["neuron_device_name"] = torch.neuron.get_device_name(0)
        found["jax_platforms"] = jax.config.jax_platforms
        from torchneuron.runtime import executable_store
        # What stored executables are keyed by: the PJRT version, plugin packages and driver.
        found["fingerprint_platform"] = executable_store.fingerprint_details()["platform"]
    found["jax_devices"] = [str(d) for d in jax.devices()]
    try:
        query = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        found["nvidia_smi"] = query.stdout.strip() or query.stderr.strip()
    except (OSError, subprocess.SubprocessError) as err:
        found["nvidia_smi"] = f"not available ({type(err).__name__})"
    for name, value in found.items():
        print(f"{name}: {value}")
    return found


def _parity(name, model, inputs, targets):
    need_neuron()
    ref = reference_device()
    torch.manual_seed(0)
    loss_n, grads_n, params_n = train_step(model, inputs, targets, "neuron")
    loss_r, grads_r, params_r = train_step(model, inputs, targets, ref)
    found = {"reference": ref, "loss_neuron": loss_n, "loss_reference": loss_r,
             "loss_relative_diff": abs(loss_n - loss_r) / max(abs(loss_r), 1e-6)}
    found["grad_max_relative_diff"], found["grad_worst"] = max_relative_diff(grads_n, grads_r)
    found["param_max_relative_diff"], found["param_worst"] = max_relative_diff(params_n, params_r)
    # float32 on both sides, TF32 off in the reference: differences are rounding, ~1e-6..1e-4.
    found["ok"] = all(found[k] < 1e-3 for k in ("loss_relative_diff", "grad_max_relative_diff",
                                                 "param_max_relative_diff"))
    print(f"{name}: loss {loss_n:.6f} (neuron) vs {loss_r:.6f} ({ref}); max relative diff grads "
          f"{found['grad_max_relative_diff']:.2e} ({found['grad_worst']}), params "
          f"{found['param_max_relative_diff']:.2e} ({found['param_worst']}) -> "
          f"{'ok' if found['ok'] else 'MISMATCH'}")
    if not found["ok"]:
        raise AssertionError(f"{name}: neuron differs from {ref} beyond 1e-3 (relative): {found}")
    return found


# PyTorch's float32 convolutions may use TF32 on CUDA by default; neuron computes in full float32.
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False


@section("parity_gpt")
def parity_gpt():
    torch.manual_seed(0)
    return _parity("gpt", GPT(), *gpt_batch())


@section("parity_conv")
def parity_conv():
    torch.manual_seed(0)
    return _parity("conv", ConvNet(), *conv_batch())


def _per_call_us(fn, device, calls, repeats=5):
    fn()
    sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync(device)
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


@section("overhead")
def overhead():
    need_neuron()
    ref = reference_device()
    ops = {
        "add 64x64": lambda a, b: a + b,
        "mul scalar 64x64": lambda a, b: a * 0.5,
        "relu 64x64": lambda a, b: torch.relu(a),
        "in-place add_ 64x64": lambda a, b: a.add_(b),
        "sum 64x64": lambda a, b: a.sum(),
        "matmul 64x64": lambda a, b: a @ b,
    }
    g = torch.Generator().manual_seed(0)
    host = [torch.randn(64, 64, generator=g) for _ in range(2)]
    found = {"reference": ref, "unit": "us per call", "ops": {}}
    print(f"{'op':<22}{'neuron us':>12}{ref + ' us':>12}{'ratio':>8}")
    for name, fn in ops.items():
        row = {}
        for device in ("neuron", ref):
            a, b = (t.to(device) for t in host)
            row["neuron" if device == "neuron" else "reference"] = _per_call_us(
                lambda fn=fn, a=a, b=b: fn(a, b), device, calls=200)
        row["ratio"] = row["neuron"] / row["reference"]
        found["ops"][name] = row
        print(f"{name:<22}{row['neuron']:>12.1f}{row['reference']:>12.1f}{row['ratio']:>8.2f}")
    found["median_ratio"] = statistics.median(r["ratio"] for r in found["ops"].values())
    return found


@section("compiled")
def compiled():
    need_neuron()
    ref = reference_device()
    torch.manual_seed(0)
    model = GPT().eval()
    inputs, _ = gpt_batch(batch=8, length=64)
    found = {"reference": ref, "unit": "ms per forward", "batch": [8, 64]}
    neuron_model = copy.deepcopy(model).to("neuron")
    compiled_model = torch.compile(neuron_model, backend="neuron")
    x = inputs.to("neuron")
    with torch.no_grad():
        start = time.perf_counter()
        out_n = compiled_model(x)
        sync("neuron")
        found["neuron_compile_s"] = time.perf_counter() - start
        found["neuron_compiled"] = _per_call_us(lambda: compiled_model(x), "neuron", calls=20, repeats=3) / 1e3
        found["neuron_eager"] = _per_call_us(lambda: neuron_model(x), "neuron", calls=5, repeats=3) / 1e3
        ref_model, xr = copy.deepcopy(model).to(ref), inputs.to(ref)
        out_r = ref_model(xr)
        found["reference_eager"] = _per_call_us(lambda: ref_model(xr), ref, calls=20, repeats=3) / 1e3
        found["max_abs_diff"] = float((out_n.cpu() - out_r.cpu()).abs().max())
        if ref == "cuda":
            try:
                inductor = torch.compile(ref_model)
                start = time.perf_counter()
                inductor(xr)
                sync(ref)
                found["inductor_compile_s"] = time.perf_counter() - start
                found["inductor"] = _per_call_us(lambda: inductor(xr), ref, calls=20, repeats=3) / 1e3
            except Exception as err:  # noqa: BLE001 - Inductor needs triton; its absence is a finding
                found["inductor_error"] = f"{type(err).__name__}: {err}"[:500]
    found["compiled_vs_reference_eager"] = found["reference_eager"] / found["neuron_compiled"]
    for name, value in found.items():
        print(f"{name}: {value:.3f}" if isinstance(value, float) else f"{name}: {value}")
    return found


def _pjrt_peak():
    from torchneuron.runtime import pjrt
    stats = pjrt.device(0).memory_stats() or {}
    return stats.get("peak_bytes_in_use"), stats.get("bytes_in_use")


@section("memory")
def memory():
    need_neuron()
    ref = reference_device()
    torch.manual_seed(0)
    model = GPT()
    inputs, targets = gpt_batch(batch=8, length=64)
    found = {"unit": "bytes", "reference": ref}
    torch.neuron.reset_peak_memory_stats()
    found["pjrt_before"] = _pjrt_peak()
    train_step(model, inputs, targets, "neuron")
    found["neuron_max_memory_allocated"] = torch.neuron.max_memory_allocated()
    found["pjrt_after"] = _pjrt_peak()   # (peak_bytes_in_use, bytes_in_use); None: not reported
    if ref == "cuda":
        torch.cuda.reset_peak_memory_stats()
        train_step(model, inputs, targets, "cuda")
        found["cuda_max_memory_allocated"] = torch.cuda.max_memory_allocated()
    for name, value in found.items():
        print(f"{name}: {value}")
    return found


class HFCausalLM(nn.Module):
    """A tiny random Llama from transformers' own code, returning logits like the GPT."""

    def __init__(self):
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM
        config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
        self.model = LlamaForCausalLM(config)

    def forward(self, idx):
        return self.model(input_ids=idx).logits


@section("parity_hf")
def parity_hf():
    torch.manual_seed(0)
    return _parity("hf_llama", HFCausalLM(), *gpt_batch())


def _compiled_train_step(model, device, backend):
    """A compiled training step of ``model`` on ``device``: (step function, inputs, targets)."""
    model = copy.deepcopy(model).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    inputs, targets = (t.to(device) for t in gpt_batch(batch=8, length=64))

    def step():
        logits = model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return (torch.compile(step, backend=backend) if backend else step), device


@section("compiled_train")
def compiled_train():
    need_neuron()
    ref = reference_device()
    torch.manual_seed(0)
    model = GPT()
    configs = {"neuron_compiled": ("neuron", "neuron"), "reference_eager": (ref, None)}
    if ref == "cuda":
        configs["inductor"] = (ref, "inductor")
    found = {"reference": ref, "unit": "ms per step", "batch": [8, 64]}
    for name, (device, backend) in configs.items():
        try:
            step, device = _compiled_train_step(model, device, backend)
            start = time.perf_counter()
            losses = [float(step()) for _ in range(3)]   # compiles (forward, backward, optimizer)
            sync(device)
            found[f"{name}_first_3_steps_s"] = time.perf_counter() - start
            found[name] = _per_call_us(step, device, calls=10, repeats=3) / 1e3
            found[f"{name}_losses"] = losses
        except Exception as err:  # noqa: BLE001 - Inductor needs triton; its absence is a finding
            if name == "neuron_compiled":
                raise
            found[f"{name}_error"] = f"{type(err).__name__}: {err}"[:500]
    n, r = found["neuron_compiled_losses"], found["reference_eager_losses"]
    found["loss_max_relative_diff"] = max(abs(a - b) / max(abs(b), 1e-6) for a, b in zip(n, r))
    found["compiled_vs_reference_eager"] = found["reference_eager"] / found["neuron_compiled"]
    if "inductor" in found:
        found["compiled_vs_inductor"] = found["inductor"] / found["neuron_compiled"]
    for name, value in found.items():
        print(f"{name}: {value:.3f}" if isinstance(value, float) else f"{name}: {value}")
    if found["loss_max_relative_diff"] > 1e-3:
        raise AssertionError(f"compiled training losses differ from {ref}'s beyond 1e-3: {n} vs {r}")
    return found


def collectives_worker(out: str) -> int:
    """One torchrun rank of the ``collectives`` section: results go to ``out``.rank<r>.json."""
    import torch.distributed as dist
    need_neuron()
    dist.init_process_group("neuron")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.distributed_c10d._get_default_group()   # the neuron process group itself
    found = {"rank": rank, "world": world, "group": type(group).__name__,
             "engine": getattr(group, "engine_name", None), "transport": type(getattr(group, "_stage", None)).__name__}
    dev = torch.device("neuron")
    x = torch.arange(1000, dtype=torch.float32, device=dev) * (rank + 1)
    dist.all_reduce(x)
    expect = torch.arange(1000, dtype=torch.float32) * sum(range(1, world + 1))
    checks = {"all_reduce": bool(torch.equal(x.cpu(), expect))}
    gathered = torch.empty(world * 8, device=dev)
    dist.all_gather_into_tensor(gathered, torch.full((8,), float(rank), device=dev))
    checks["all_gather_into_tensor"] = bool(torch.equal(
        gathered.cpu(), torch.arange(world).float().repeat_interleave(8)))
    shard = torch.empty(4, device=dev)
    dist.reduce_scatter_tensor(shard, torch.ones(world * 4, device=dev))
    checks["reduce_scatter_tensor"] = bool(torch.equal(shard.cpu(), torch.full((4,), float(world))))
    b = torch.full((16,), float(rank), device=dev)
    dist.broadcast(b, src=0)
    checks["broadcast"] = bool(torch.equal(b.cpu(), torch.zeros(16)))
    found["checks"] = checks
    big = torch.ones(16 << 20, device=dev)   # 64 MiB
    dist.all_reduce(big)
    torch.neuron.synchronize()
    before = {k: torchneuron.metrics()[k] for k in ("d2h_copies", "h2d_copies")}
    times = []
    for _ in range(5):
        start = time.perf_counter()
        dist.all_reduce(big)
        torch.neuron.synchronize()
        times.append(time.perf_counter() - start)
    found["all_reduce_64MiB_ms"] = statistics.median(times) * 1e3
    # Host<->device copies made by the five timed all-reduces (none when the tensors are shared).
    found["host_copies_of_5_all_reduces"] = {k: torchneuron.metrics()[k] - v for k, v in before.items()}
    dist.destroy_process_group()
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump(found, f)
    return 0 if all(checks.values()) else 1


@section("collectives")
def collectives():
    need_neuron()
    ranks = 2 if torch.cuda.device_count() >= 2 or not torch.cuda.is_available() else 1
    out = os.path.join(tempfile.mkdtemp(prefix="torchneuron-smoke-dist-"), "result")
    env = dict(os.environ, TORCHNEURON_COLLECTIVES="shared", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
           os.path.abspath(__file__), "--collectives-worker", out]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150)
    found = {"ranks": ranks, "returncode": proc.returncode}
    for r in range(ranks):
        path = f"{out}.rank{r}.json"
        found[f"rank{r}"] = json.load(open(path)) if os.path.exists(path) else None
    for name, value in found.items():
        print(f"{name}: {value}")
    if proc.returncode != 0 or any(found[f"rank{r}"] is None for r in range(ranks)):
        raise RuntimeError(f"torchrun exited with {proc.returncode}:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return found


TESTS_BUDGET_S = 120
TEST_MODULES = ("tests/test_device_module.py", "tests/test_memory.py", "tests/test_cache.py",
                "tests/test_kernels.py")


@section("tests")
def tests():
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(root, "src"), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", *TEST_MODULES]
    try:
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=TESTS_BUDGET_S)
        output, timed_out = proc.stdout + proc.stderr, False
    except subprocess.TimeoutExpired as err:
        output = (err.stdout or b"").decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
        timed_out = True
    lines = output.splitlines()
    found = {"modules": list(TEST_MODULES), "timed_out": timed_out,
             "summary": next((ln for ln in reversed(lines) if " in " in ln and ("passed" in ln or "failed" in ln
                                                                               or "error" in ln)), None),
             "failures": [ln for ln in lines if ln.startswith(("FAILED ", "ERROR "))][:60]}
    for name, value in found.items():
        print(f"{name}: {value}")
    if timed_out:
        raise TimeoutError(f"the test modules did not finish within {TESTS_BUDGET_S} s; last output:\n"
                           + "\n".join(lines[-20:]))
    return found


def summary():
    sections = RESULTS["sections"]
    failed = [n for n, s in sections.items() if not s["ok"]]
    parts = [f"{len(sections) - len(failed)}/{len(sections)} sections ok"]
    if failed:
        parts.append("failed: " + ", ".join(failed))
    facts_ = sections.get("facts", {}).get("result") or {}
    parts.append(f"platform {facts_.get('neuron_platform')} vs reference {facts_.get('reference')}")
    over = sections.get("overhead", {}).get("result")
    if over:
        parts.append(f"eager op median {over['median_ratio']:.2f}x the reference's time")
    comp = sections.get("compiled", {}).get("result")
    if comp:
        parts.append(f"compiled forward {comp['neuron_compiled']:.3f} ms vs reference eager "
                     f"{comp['reference_eager']:.3f} ms")
    line = "SUMMARY: " + "; ".join(parts)
    RESULTS["summary"] = line
    return line


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the results as JSON to this path")
    parser.add_argument("--collectives-worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.collectives_worker:
        return collectives_worker(args.collectives_worker)
    RESULTS["date"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    start = time.perf_counter()
    for name, fn in SECTIONS:
        run_section(name, fn)
    RESULTS["seconds"] = round(time.perf_counter() - start, 1)
    print(f"\n{summary()} ({RESULTS['seconds']} s)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(RESULTS, f, indent=2, default=str)
        print(f"results written to {args.out}")
    return 0 if all(s["ok"] for s in RESULTS["sections"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
