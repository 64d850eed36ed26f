"""torch.distributed on neuron tensors: the ``neuron`` c10d backend, 2 processes on one machine.

Each test launches worker processes (this file, run as a script: ``python test_distributed.py
<worker> <out_dir>``) with the environment torchrun would give them, under a hard deadline so a
hang fails the test instead of CI. Results are compared here against single-process CPU PyTorch.
One launch ("suite") runs the scenarios that can share a process group (collectives, tensor
parallelism, FSDP2, pipeline parallelism, checkpoint saving), to pay process start-up and
executable compilation once.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

WORLD = 2
HERE = Path(__file__).resolve()
ROOT = HERE.parent.parent
LAUNCH_DEADLINE = 480   # seconds for one multi-process launch, start-up and compiles included


# -- models and data shared by the workers and the CPU references ---------------------------------
class Block(torch.nn.Module):
    """A pre-norm transformer block: attention and an MLP."""

    def __init__(self, d=16, heads=2):
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(d)
        self.attn = torch.nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = torch.nn.LayerNorm(d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyTransformer(torch.nn.Module):
    def __init__(self, vocab=32, d=16, layers=2):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList([Block(d) for _ in range(layers)])
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, tokens):
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class MLP(torch.nn.Module):
    def __init__(self, d=16, hidden=32):
        super().__init__()
        self.up = torch.nn.Linear(d, hidden)
        self.down = torch.nn.Linear(hidden, d)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _tokens(step):
    g = torch.Generator().manual_seed(10 + step)
    return torch.randint(0, 32, (4, 8), generator=g), torch.randint(0, 32, (4, 8), generator=g)


def _regression(step, batch=8, d=16):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(batch, d, generator=g), torch.randn(batch, d, generator=g)


def pipeline_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU()) for _ in range(4)])


FSDP_STEPS, TP_STEPS, DCP_STEPS, PP_STEPS, PP_MICROBATCHES, LR = 3, 3, 4, 2, 2, 0.1


# -- the launcher ---------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_env(rank: int, port: int, extra: dict | None = None) -> dict:
    env = dict(os.environ, **(extra or {}))
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
               LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]))
    return env


class _Job:
    """WORLD worker processes started now; ``result()`` waits for them until the deadline."""

    def __init__(self, out: Path, worker: str, *args: str, deadline: float = LAUNCH_DEADLINE,
                 env: dict | None = None):
        out.mkdir(parents=True, exist_ok=True)
        self.worker, self.deadline = worker, deadline
        self.end = time.monotonic() + deadline
        port = _free_port()
        self.logs = [open(out / f"{worker}.rank{rank}.log", "w+") for rank in range(WORLD)]
        self.procs = [subprocess.Popen([sys.executable, str(HERE), worker, str(out), *args], cwd=ROOT,
                                       env=_worker_env(rank, port, env), stdout=log, stderr=subprocess.STDOUT)
                      for rank, log in enumerate(self.logs)]
        self._result = None

    def result(self) -> list[tuple[int, str]]:
        """Each rank's (exit code, output); kills every rank and fails if the deadline passes."""
        if self._result is None:
            try:
                for p in self.procs:
                    p.wait(timeout=max(1.0, self.end - time.monotonic()))
            except subprocess.TimeoutExpired:
                for p in self.procs:
                    if p.poll() is None:
                        p.kill()
                        p.wait()
                text = "\n".join(f"--- rank {r} ---\n{_read(log)}" for r, log in enumerate(self.logs))
                raise AssertionError(f"worker {self.worker!r} did not finish within {self.deadline} s "
                                     f"(a hang):\n{text[-6000:]}") from None
            self._result = [(p.returncode, _read(log)) for p, log in zip(self.procs, self.logs)]
        return self._result


def _launch(out: Path, worker: str, *args: str, deadline: float = LAUNCH_DEADLINE,
            env: dict | None = None) -> list[tuple[int, str]]:
    return _Job(out, worker, *args, deadline=deadline, env=env).result()


def _read(log) -> str:
    log.flush()
    log.seek(0)
    text = log.read()
    log.close()
    return text


def _check_ok(results, worker):
    for rank, (code, output) in enumerate(results):
        assert code == 0, f"{worker} rank {rank} exited with {code}:\n{output[-6000:]}"


# -- tests ----------------------------------------------------------------------------------------
import pytest  # noqa: E402 - workers do not need pytest


@pytest.fixture(scope="module")
def failure_jobs(tmp_path_factory):
    """The failure scenarios mostly wait, so they run alongside the suite."""
    jobs = {}
    for name in ("dead_rank", "stuck_rank"):
        out = tmp_path_factory.mktemp(name)
        jobs[name] = (out, _Job(out, name, deadline=LAUNCH_DEADLINE))
    return jobs


@pytest.fixture(scope="module")
def suite(tmp_path_factory, failure_jobs):
    """One launch running the collectives, TP, FSDP2, pipeline and checkpoint-saving scenarios."""
    out = tmp_path_factory.mktemp("dist_suite")
    results = _launch(out, "suite")
    return out, results


def _scenario(suite, name):
    out, results = suite
    for rank, (code, output) in enumerate(results):
        status = out / f"{name}.rank{rank}.status"
        assert status.exists(), f"rank {rank} never reached scenario {name} (exit {code}):\n{output[-6000:]}"
        text = status.read_text()
        assert text == "ok", f"scenario {name} failed on rank {rank}:\n{text}"
    return out


SCENARIOS = ("collectives", "tp", "fsdp", "pipeline", "dcp_train")


def test_every_scenario_matches_cpu_with_dlpack_shared_tensors(tmp_path):
    # TORCHNEURON_COLLECTIVES=shared: the engine works on torch tensors that share the device
    # buffers through DLPack (NCCL's path on CUDA), here with gloo on the CPU platform; the
    # collectives scenario also checks that no host copy is made.
    results = _launch(tmp_path, "suite", env={"TORCHNEURON_COLLECTIVES": "shared"})
    for name in SCENARIOS:
        _scenario((tmp_path, results), name)


def test_collectives_match_cpu(suite):
    out = _scenario(suite, "collectives")
    counts = json.loads((out / "collectives.rank0.json").read_text())
    # Every collective the issue lists ran through the backend and was counted.
    for name in ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
                 "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "scatter", "barrier",
                 "send", "recv", "all_reduce_coalesced"):
        assert counts["collectives"].get(name, 0) > 0, (name, counts["collectives"])
    assert counts["collective_bytes"] > 0 and counts["collective_seconds"] > 0


def test_tensor_parallel_mlp_matches_cpu(suite):
    out = _scenario(suite, "tp")
    torch.manual_seed(0)
    ref = MLP()
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    losses = []
    for step in range(TP_STEPS):
        x, y = _regression(step)
        loss = torch.nn.functional.mse_loss(ref(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    got = torch.load(out / "tp.rank0.pt")
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(losses), rtol=1e-5, atol=1e-6)
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(got["params"][name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_fsdp2_transformer_matches_cpu(suite):
    out = _scenario(suite, "fsdp")
    torch.manual_seed(0)
    ref = TinyTransformer()
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    losses = []
    for step in range(FSDP_STEPS):
        tokens, target = _tokens(step)
        loss = torch.nn.functional.cross_entropy(ref(tokens).flatten(0, 1), target.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    got = torch.load(out / "fsdp.rank0.pt")
    # Each rank's loss is the mean over its half of the batch; their average is the full-batch loss.
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(losses), rtol=1e-4, atol=1e-5)
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(got["params"][name], value, rtol=1e-4, atol=1e-5, msg=name)


def test_pipeline_parallel_matches_cpu(suite):
    out = _scenario(suite, "pipeline")
    ref = pipeline_model()
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    losses = []
    for step in range(PP_STEPS):
        x, y = _regression(step)
        # GPipe: the mean of the micro-batch losses (gradients are scaled by the micro-batch count).
        micro = [torch.nn.functional.mse_loss(ref(xm), ym) for xm, ym in
                 zip(x.chunk(PP_MICROBATCHES), y.chunk(PP_MICROBATCHES))]
        loss = sum(micro) / PP_MICROBATCHES
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append([m.item() for m in micro])
    got = torch.load(out / "pipeline.rank1.pt")
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(losses), rtol=1e-5, atol=1e-6)
    per_stage = len(ref) // WORLD
    for rank in range(WORLD):
        stage_params = torch.load(out / f"pipeline.rank{rank}.pt")["params"]
        expected = torch.nn.Sequential(*list(ref)[rank * per_stage:(rank + 1) * per_stage]).state_dict()
        for name, value in expected.items():
            torch.testing.assert_close(stage_params[name], value, rtol=1e-5, atol=1e-6, msg=f"stage {rank} {name}")


def test_checkpoint_save_load_resume(suite, tmp_path):
    out = _scenario(suite, "dcp_train")
    uninterrupted = json.loads((out / "dcp_train.rank0.json").read_text())["losses"]
    assert len(uninterrupted) == DCP_STEPS
    results = _launch(tmp_path, "dcp_resume", str(out / "checkpoint"))
    _check_ok(results, "dcp_resume")
    for rank in range(WORLD):
        resumed = json.loads((tmp_path / f"dcp_resume.rank{rank}.json").read_text())
        # Fresh processes with differently initialised models continue exactly where the run was.
        assert resumed["initial_loss_differs"]
        torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(uninterrupted[DCP_STEPS // 2:]),
                                   rtol=1e-6, atol=1e-7)


def test_dead_rank_fails_peers_with_clear_error(failure_jobs):
    out, job = failure_jobs["dead_rank"]
    results = job.result()
    code, output = results[0]
    assert code == 1, f"rank 0 should fail, exited {code}:\n{output[-4000:]}"
    err = json.loads((out / "dead_rank.rank0.json").read_text())
    assert err["type"] == "CollectiveError", err
    assert re.search(r"torchneuron: all_reduce of \[float32\[64\]\] \(neuron:0\) failed on rank 0 of 2", err["message"]), err
    assert "peer process exited or stopped responding" in err["message"], err
    assert results[1][0] == 3   # the rank that died


def test_unresponsive_rank_times_out_with_clear_error(failure_jobs):
    out, job = failure_jobs["stuck_rank"]
    results = job.result()
    code, output = results[0]
    assert code == 1, f"rank 0 should fail, exited {code}:\n{output[-4000:]}"
    err = json.loads((out / "stuck_rank.rank0.json").read_text())
    assert err["type"] == "CollectiveError", err
    assert "Timed out" in err["message"] and "0:00:05" in err["message"], err


def test_torchrun_ddp_example_matches_single_process(tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun)] if torchrun.exists() else [sys.executable, "-m", "torch.distributed.run"]
    steps, batch, lr = 4, 16, 0.05
    cmd += ["--nproc-per-node", str(WORLD), "--master-port", str(_free_port()),
            str(ROOT / "examples" / "ddp_train.py"), "--steps", str(steps), "--batch-size", str(batch), "--lr", str(lr)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=LAUNCH_DEADLINE)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)   # torchrun and the workers it started
        output, _ = proc.communicate()
        raise AssertionError(f"torchrun example did not finish within {LAUNCH_DEADLINE} s:\n{output[-6000:]}") from None
    assert proc.returncode == 0, output[-6000:]
    # Another rank's C++ warning may land on the same line (the ranks share the output pipe).
    got = [float(v) for v in re.findall(r"step \d+ loss ([0-9]+\.[0-9]{6})", output)]

    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import ddp_train
    finally:
        sys.path.remove(str(ROOT / "examples"))
    model = ddp_train.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    expected = []
    for step in range(steps):
        x, target = ddp_train.make_batch(step, batch)
        loss = torch.nn.functional.mse_loss(model(x), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        expected.append(loss.item())
    assert len(got) == steps, output[-4000:]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=1e-6)


# -- workers (run in the launched processes) --------------------------------------------------------
def _init(timeout_s=120, backend=None):
    import torch.distributed as dist

    import torchneuron  # noqa: F401 - registers the device and the backend, as `import torch` does
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return dist, dist.get_rank()


def _expect(got, expected, what):
    got = got.cpu() if isinstance(got, torch.Tensor) else got
    if not torch.equal(got, expected):
        raise AssertionError(f"{what}: got {got}, expected {expected}")


def _scenario_collectives(dist, rank, out):
    import torch.distributed._functional_collectives as funcol

    import torchneuron
    from torchneuron.distributed import CollectiveError, NeuronWork, ProcessGroupNeuron
    assert isinstance(dist.group.WORLD, ProcessGroupNeuron), type(dist.group.WORLD)
    world = dist.get_world_size()
    dev = "neuron"

    def inp(r, n=6, dtype=torch.float32):
        return (torch.arange(n, dtype=torch.float32) + 10 * r + 1).to(dtype)

    everyone = [inp(r) for r in range(world)]
    reductions = {dist.ReduceOp.SUM: sum(everyone), dist.ReduceOp.AVG: sum(everyone) / world,
                  dist.ReduceOp.PRODUCT: everyone[0] * everyone[1], dist.ReduceOp.MIN: torch.minimum(*everyone),
                  dist.ReduceOp.MAX: torch.maximum(*everyone)}
    for op, expected in reductions.items():
        x = inp(rank).to(dev)
        dist.all_reduce(x, op)
        _expect(x, expected, f"all_reduce {op}")
    for dtype in (torch.bfloat16, torch.int64, torch.float16):
        x = inp(rank, dtype=dtype).to(dev)
        dist.all_reduce(x)
        _expect(x, sum(inp(r, dtype=dtype) for r in range(world)), f"all_reduce {dtype}")
    # A row of a bigger tensor: the result lands in the view, the rest is untouched.
    base = torch.stack([inp(rank), -inp(rank)]).to(dev)
    dist.all_reduce(base[1])
    _expect(base, torch.stack([inp(rank), -sum(everyone)]), "all_reduce on a view")
    x = inp(rank).to(dev)
    dist.all_reduce(x, op=dist._make_nccl_premul_sum(0.5))
    _expect(x, sum(everyone) * 0.5, "all_reduce PREMUL_SUM")

    work = dist.all_reduce(x := inp(rank).to(dev), async_op=True)
    assert isinstance(work, NeuronWork)
    value = work.get_future().wait()
    assert work.is_completed() and work.is_success()
    _expect(value[0], sum(everyone), "async all_reduce future value")
    _expect(x, sum(everyone), "async all_reduce")

    x = inp(rank).to(dev)
    dist.broadcast(x, src=1)
    _expect(x, inp(1), "broadcast")
    x = inp(rank).to(dev)
    dist.reduce(x, dst=0, op=dist.ReduceOp.MAX)
    _expect(x, torch.maximum(*everyone) if rank == 0 else inp(rank), "reduce")

    gathered = torch.empty(world, 6, device=dev)
    dist.all_gather(list(gathered.unbind(0)), inp(rank).to(dev))   # outputs are views of one tensor
    _expect(gathered, torch.stack(everyone), "all_gather into views")
    flat = torch.empty(world * 6, device=dev)
    dist.all_gather_into_tensor(flat, inp(rank).to(dev))
    _expect(flat, torch.cat(everyone), "all_gather_into_tensor")
    half = torch.empty(3, device=dev)
    dist.reduce_scatter_tensor(half, inp(rank).to(dev))
    _expect(half, sum(everyone)[3 * rank:3 * rank + 3], "reduce_scatter_tensor")
    half = torch.empty(3, device=dev)
    dist.reduce_scatter(half, list(inp(rank).to(dev).chunk(world)))
    _expect(half, sum(everyone)[3 * rank:3 * rank + 3], "reduce_scatter")
    swapped = torch.empty(6, device=dev)
    dist.all_to_all_single(swapped, inp(rank).to(dev))
    _expect(swapped, torch.cat([e[3 * rank:3 * rank + 3] for e in everyone]), "all_to_all_single")
    uneven = torch.empty(3 if rank == 0 else 9, device=dev)   # rank r sends r+1 elements to rank 0
    dist.all_to_all_single(uneven, inp(rank).to(dev), output_split_sizes=[1, 2] if rank == 0 else [5, 4],
                           input_split_sizes=[rank + 1, 5 - rank])
    _expect(uneven, torch.cat([everyone[0][:1], everyone[1][:2]]) if rank == 0
            else torch.cat([everyone[0][1:], everyone[1][2:]]), "all_to_all_single with splits")
    parts = [torch.empty(3, device=dev) for _ in range(world)]
    dist.all_to_all(parts, list(inp(rank).to(dev).chunk(world)))
    for r in range(world):
        _expect(parts[r], everyone[r][3 * rank:3 * rank + 3], "all_to_all")
    bucket = [torch.empty(6, device=dev) for _ in range(world)] if rank == 0 else None
    dist.gather(inp(rank).to(dev), bucket, dst=0)
    if rank == 0:
        for r in range(world):
            _expect(bucket[r], everyone[r], "gather")
    mine = torch.empty(6, device=dev)
    dist.scatter(mine, [e.to(dev) for e in everyone] if rank == 0 else None, src=0)
    _expect(mine, inp(rank), "scatter")
    dist.barrier()

    other = 1 - rank
    if rank == 0:
        dist.send(inp(0).to(dev), dst=1)
        got = torch.empty(6, device=dev)
        assert dist.recv(got) == 1   # from any source
        _expect(got, inp(1), "recv any source")
    else:
        got = torch.empty(6, device=dev)
        dist.recv(got, src=0)
        _expect(got, inp(0), "recv")
        dist.send(inp(1).to(dev), dst=0)
    recv_into = torch.empty(6, device=dev)
    requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, inp(rank).to(dev), other),
                                       dist.P2POp(dist.irecv, recv_into, other)])
    for req in requests:
        req.wait()
    _expect(recv_into, inp(other), "batch_isend_irecv")

    # DDP and FSDP coalesce several tensors (mixed dtypes) into one collective per dtype.
    tensors = [inp(rank, 4).to(dev), inp(rank, 5, torch.bfloat16).to(dev), inp(rank, 3).to(dev)]
    with dist._coalescing_manager(async_ops=True) as cm:
        for t in tensors:
            dist.all_reduce(t)
    cm.wait()
    for t in tensors:
        _expect(t, sum(inp(r, t.numel(), t.dtype) for r in range(world)), "coalesced all_reduce")
    outs = [torch.empty(world * 4, device=dev), torch.empty(world * 2, device=dev)]
    with dist._coalescing_manager(async_ops=True) as cm:
        dist.all_gather_into_tensor(outs[0], inp(rank, 4).to(dev))
        dist.all_gather_into_tensor(outs[1], inp(rank, 2).to(dev))
    cm.wait()
    _expect(outs[0], torch.cat([inp(r, 4) for r in range(world)]), "coalesced all_gather_into_tensor")
    _expect(outs[1], torch.cat([inp(r, 2) for r in range(world)]), "coalesced all_gather_into_tensor")
    shards = [torch.empty(2, device=dev), torch.empty(3, device=dev)]
    with dist._coalescing_manager(async_ops=True) as cm:
        dist.reduce_scatter_tensor(shards[0], inp(rank, 4).to(dev))
        dist.reduce_scatter_tensor(shards[1], inp(rank, 6).to(dev))
    cm.wait()
    _expect(shards[0], sum(inp(r, 4) for r in range(world))[2 * rank:2 * rank + 2], "coalesced reduce_scatter")
    _expect(shards[1], sum(inp(r, 6) for r in range(world))[3 * rank:3 * rank + 3], "coalesced reduce_scatter")

    # Functional collectives (DTensor, FSDP2) reach the group from C++.
    group = dist.group.WORLD
    _expect(funcol.all_reduce(inp(rank).to(dev), "sum", group), sum(everyone), "funcol all_reduce")
    _expect(funcol.all_gather_tensor(inp(rank).view(2, 3).to(dev), 0, group),
            torch.cat(everyone).view(4, 3), "funcol all_gather_tensor")
    _expect(funcol.reduce_scatter_tensor(inp(rank).view(2, 3).to(dev), "sum", 0, group),
            sum(everyone).view(2, 3)[rank:rank + 1], "funcol reduce_scatter_tensor")

    # CPU tensors on the same group go to gloo, object collectives too.
    before = torchneuron.metrics()["h2d_copies"]
    x = inp(rank)
    dist.all_reduce(x)
    _expect(x, sum(everyone), "CPU all_reduce through gloo")
    objects = [None] * world
    dist.all_gather_object(objects, {"rank": rank})
    assert objects == [{"rank": r} for r in range(world)], objects
    assert torchneuron.metrics()["h2d_copies"] == before, "CPU collectives must not touch the device"

    # Counted: calls, bytes, time, and the staging copies.
    ones = torch.ones(256, device=dev)
    m0 = torchneuron.metrics()
    dist.all_reduce(ones)
    m1 = torchneuron.metrics()
    assert m1["collectives"]["all_reduce"] == m0["collectives"]["all_reduce"] + 1
    assert m1["collective_bytes"] == m0["collective_bytes"] + 1024
    assert m1["collective_seconds"] > m0["collective_seconds"]
    copies = (m1["d2h_copies"] - m0["d2h_copies"], m1["h2d_copies"] - m0["h2d_copies"])
    # Host staging copies the payload out and the result in; DLPack sharing copies nothing.
    expected = (0, 0) if os.environ.get("TORCHNEURON_COLLECTIVES") == "shared" else (1, 1)
    assert copies == expected, (copies, expected)

    try:
        dist.all_gather_into_tensor(torch.empty(12), inp(rank).to(dev))
    except CollectiveError as err:
        assert "all_gather_into_tensor" in str(err) and "cpu" in str(err) and "neuron:0" in str(err), err
    else:
        raise AssertionError("mixing CPU and neuron tensors in one collective must fail")
    dist.barrier()
    metrics = torchneuron.metrics()
    return {"collectives": metrics["collectives"], "collective_bytes": metrics["collective_bytes"],
            "collective_seconds": metrics["collective_seconds"]}


def _scenario_tp(dist, rank, out):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    mesh = init_device_mesh("neuron", (WORLD,))
    torch.manual_seed(0)
    model = parallelize_module(MLP().to("neuron"), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    assert isinstance(model.up.weight, DTensor) and model.up.weight.to_local().shape == (16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(TP_STEPS):
        x, y = _regression(step)
        loss = torch.nn.functional.mse_loss(model(x.to("neuron")), y.to("neuron"))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    params = {k: v.full_tensor().cpu() if isinstance(v, DTensor) else v.cpu() for k, v in model.state_dict().items()}
    if rank == 0:
        torch.save({"losses": losses, "params": params}, out / "tp.rank0.pt")


def _scenario_fsdp(dist, rank, out):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("neuron", (WORLD,))
    torch.manual_seed(0)
    model = TinyTransformer().to("neuron")
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(FSDP_STEPS):
        tokens, target = _tokens(step)
        tokens, target = tokens.chunk(WORLD)[rank].to("neuron"), target.chunk(WORLD)[rank].to("neuron")
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), target.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        mean = loss.detach()
        dist.all_reduce(mean, op=dist.ReduceOp.AVG)
        losses.append(mean.item())
    params = {k: v.full_tensor().cpu() for k, v in model.state_dict().items()}
    if rank == 0:
        torch.save({"losses": losses, "params": params}, out / "fsdp.rank0.pt")


def _scenario_pipeline(dist, rank, out):
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
    per_stage = len(pipeline_model()) // WORLD
    module = torch.nn.Sequential(*list(pipeline_model())[rank * per_stage:(rank + 1) * per_stage]).to("neuron")
    stage = PipelineStage(module, rank, WORLD, torch.device("neuron", 0))
    schedule = ScheduleGPipe(stage, n_microbatches=PP_MICROBATCHES, loss_fn=torch.nn.functional.mse_loss)
    opt = torch.optim.SGD(module.parameters(), lr=LR)
    losses = []
    for step in range(PP_STEPS):
        x, y = _regression(step)
        opt.zero_grad()
        if rank == 0:
            schedule.step(x.to("neuron"))
        else:
            micro = []
            schedule.step(target=y.to("neuron"), losses=micro)
            losses.append([m.item() for m in micro])
        opt.step()
    torch.save({"losses": losses, "params": {k: v.cpu() for k, v in module.state_dict().items()}},
               out / f"pipeline.rank{rank}.pt")


def _dcp_setup(seed):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("neuron", (WORLD,))
    torch.manual_seed(seed)
    model = MLP().to("neuron")
    fully_shard(model.up, mesh=mesh)
    fully_shard(model.down, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)


def _dcp_step(dist, rank, model, opt, step):
    x, y = _regression(step)
    loss = torch.nn.functional.mse_loss(model(x.chunk(WORLD)[rank].to("neuron")), y.chunk(WORLD)[rank].to("neuron"))
    opt.zero_grad()
    loss.backward()
    opt.step()
    mean = loss.detach()
    dist.all_reduce(mean, op=dist.ReduceOp.AVG)
    return mean.item()


def _scenario_dcp_train(dist, rank, out):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model, opt = _dcp_setup(seed=0)
    losses = [_dcp_step(dist, rank, model, opt, step) for step in range(DCP_STEPS // 2)]
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(out / "checkpoint"))
    losses += [_dcp_step(dist, rank, model, opt, step) for step in range(DCP_STEPS // 2, DCP_STEPS)]
    (out / f"dcp_train.rank{rank}.json").write_text(json.dumps({"losses": losses}))


def worker_suite(out: Path):
    dist, rank = _init()   # the default device map: neuron tensors -> neuron, CPU tensors -> gloo
    scenarios = {"collectives": _scenario_collectives, "tp": _scenario_tp, "fsdp": _scenario_fsdp,
                 "pipeline": _scenario_pipeline, "dcp_train": _scenario_dcp_train}
    assert tuple(scenarios) == SCENARIOS
    for name, fn in scenarios.items():
        try:
            result = fn(dist, rank, out)
            if result is not None and rank == 0:
                (out / f"{name}.rank0.json").write_text(json.dumps(result))
            status = "ok"
        except BaseException:  # noqa: B036 - reported to the test, then the next scenario runs
            status = traceback.format_exc()
        (out / f"{name}.rank{rank}.status").write_text(status)
        import torchneuron
        print(f"rank {rank} {name}: {'ok' if status == 'ok' else 'FAILED'}; CPU fallbacks so far: "
              f"{dict(torchneuron.metrics()['fallbacks'])}", flush=True)
        dist.barrier()
    dist.destroy_process_group()


def worker_dcp_resume(out: Path, checkpoint: str):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    dist, rank = _init()
    model, opt = _dcp_setup(seed=1234)   # deliberately not the saved weights
    x, y = _regression(DCP_STEPS // 2)
    with torch.no_grad():
        fresh = torch.nn.functional.mse_loss(model(x.chunk(WORLD)[rank].to("neuron")), y.chunk(WORLD)[rank].to("neuron"))
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=checkpoint)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    with torch.no_grad():
        loaded = torch.nn.functional.mse_loss(model(x.chunk(WORLD)[rank].to("neuron")), y.chunk(WORLD)[rank].to("neuron"))
    losses = [_dcp_step(dist, rank, model, opt, step) for step in range(DCP_STEPS // 2, DCP_STEPS)]
    (out / f"dcp_resume.rank{rank}.json").write_text(json.dumps(
        {"losses": losses, "initial_loss_differs": abs(fresh.item() - loaded.item()) > 1e-4}))
    dist.destroy_process_group()


def _record_failure(out: Path, name: str, rank: int, fn):
    try:
        fn()
    except Exception as err:
        (out / f"{name}.rank{rank}.json").write_text(json.dumps({"type": type(err).__name__, "message": str(err)}))
        raise


def worker_dead_rank(out: Path):
    dist, rank = _init(timeout_s=60, backend="neuron")
    x = torch.ones(64, device="neuron")

    def loop():
        for step in range(10):
            if rank == 1 and step == 3:
                os._exit(3)   # dies without a word, as a crashed or OOM-killed process would
            dist.all_reduce(x)
    _record_failure(out, "dead_rank", rank, loop)


def worker_stuck_rank(out: Path):
    dist, rank = _init(backend="neuron")
    # Start-up on a loaded machine can take longer than 5 s: only the collectives get the short timeout.
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=5))
    x = torch.ones(64, device="neuron")

    def loop():
        for step in range(10):
            if rank == 1 and step == 3:
                time.sleep(15)   # alive but not joining the collective, well past the 5 s timeout
                os._exit(0)
            dist.all_reduce(x, group=group)
    _record_failure(out, "stuck_rank", rank, loop)


if __name__ == "__main__":
    globals()[f"worker_{sys.argv[1]}"](Path(sys.argv[2]), *sys.argv[3:])
