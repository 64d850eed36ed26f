"""The ``neuron`` c10d process group: collectives on neuron tensors, run by an existing engine.

c10d cannot take a Python ``Backend``, but it accepts a Python ``ProcessGroup`` subclass from a
registered creator; its methods are reached both from ``torch.distributed``'s Python API and from
C++ callers (DDP's reducer, functional collectives used by DTensor/FSDP2) through PyTorch's
trampoline. Every collective here:

1. gives each neuron input to the engine as a tensor of its own (``staging``: a host copy for gloo,
   or a device copy shared through DLPack for NCCL on CUDA, ``config.collectives``);
2. runs the same collective on those tensors with an internal ``ProcessGroupGloo`` (or
   ``ProcessGroupNCCL``), which owns the transport, the rendezvous through the c10d store, and the
   timeout;
3. when the engine completes, writes results back into the neuron outputs, on the thread that
   waits for the ``Work`` or, for futures (DDP), on the engine's thread; then the work is complete.

CPU tensors skip the staging and go straight to gloo, so one group serves both devices (the default
``init_process_group()`` device map routes CPU to gloo this way). The internal gloo backend is also
registered as the group's CPU backend, so object collectives, ``group_name`` and timeouts behave as
for any gloo group.
"""

from __future__ import annotations

import datetime
import queue
import threading
import time
import warnings
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllreduceOptions,
    ProcessGroupGloo,
    ReduceOp,
    ReduceScatterOptions,
)

from ..config import config
from ..metrics import metrics
from . import staging

BACKEND_NAME = "neuron"
_RedOpType = ReduceOp.RedOpType
_SUM = ReduceOp(_RedOpType.SUM)
_metrics_lock = threading.Lock()


class CollectiveError(RuntimeError):
    """A collective on the ``neuron`` process group failed (or a peer did)."""


class _Completer:
    """One thread that waits for gloo works which have no future (send/recv, reduce-scatter)."""

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, work, future: torch.futures.Future):
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="torchneuron-c10d", daemon=True)
                self._thread.start()
        self._queue.put((work, future))

    def _run(self):
        while True:
            work, future = self._queue.get()
            try:
                work.wait()
            except Exception as err:
                future.set_result(err)   # the `then` callback turns it into the collective's error
                continue
            future.set_result(None)


_completer = _Completer()


class _Completion:
    """The end of one gloo collective: copy results back and count it, exactly once.

    Whichever thread gets there first runs it: the caller in ``wait()`` (the common, synchronous
    case: no thread hand-off), or gloo's thread when someone asked for the future (DDP's reducer).
    """

    __slots__ = ("work", "complete", "name", "lock", "done", "value", "error", "_future")

    def __init__(self, work, complete: Callable[[BaseException | None], object], name: str = "collective"):
        self.work = work
        self.complete = complete
        self.name = name
        self.lock = threading.Lock()
        self.done = False
        self.value = None
        self.error: BaseException | None = None
        self._future: torch.futures.Future | None = None

    def finish(self, err: BaseException | None = None):
        with self.lock:
            if not self.done:
                try:
                    self.value = self.complete(err)
                except BaseException as failure:  # noqa: B036 - kept and re-raised to every waiter
                    self.error = failure
                self.done = True
        if self.error is not None:
            raise self.error
        return self.value

    def wait(self):
        if not self.done:
            try:
                self.work.wait()
            except Exception as err:
                return self.finish(err)
        return self.finish()

    def poll(self) -> bool:
        if not self.done and self.work.is_completed():
            try:
                self.wait()   # a completed work returns at once, or raises its error for finish()
            except Exception:  # noqa: BLE001 - kept in self.error for exception() and wait()
                pass
        return self.done

    def future(self) -> torch.futures.Future:
        if self._future is None:
            if self.done:
                base = torch.futures.Future()
                base.set_result(None)
            else:
                try:
                    base = self.work.get_future()
                except RuntimeError:   # gloo's send/recv/reduce-scatter works have no future
                    base = torch.futures.Future()
                    _completer.submit(self.work, base)

            def on_done(fut):
                # Raising here is what marks the chained future failed for C++ waiters too;
                # Future.set_exception would not.
                try:
                    outcome = fut.value()
                except Exception as failure:
                    outcome = failure
                return self.finish(outcome if isinstance(outcome, BaseException) else None)
            self._future = base.then(on_done)
        return self._future


class NeuronWork(dist.Work):
    """Collectives in flight. ``wait()`` returns once the results are in the output tensors.

    ``get_future()`` completes after the copy back to the device, so its callbacks (DDP's comm
    hooks) and C++ waiters (functional collectives) see finished neuron tensors.
    """

    def __init__(self, completions: Sequence[_Completion], source_rank: Callable[[], int] | None = None):
        super().__init__()
        self._completions = list(completions)
        self._future: torch.futures.Future | None = None
        self._source_rank_fn = source_rank
        self._observed = False   # whether wait(), exception(), the future... can report an error

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self._observed = True
        seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
        if seconds and seconds > 0 and not self.is_completed():
            finished = threading.Event()
            self.get_future().add_done_callback(lambda _: finished.set())
            if not finished.wait(seconds):
                raise CollectiveError(
                    f"torchneuron: Work.wait(timeout={seconds:.3g} s) expired before the collective "
                    "finished; the collective itself keeps running until the process group's timeout. "
                    "Wait without a timeout, or raise it.")
        for c in self._completions:
            c.wait()
        return True

    def get_future(self) -> torch.futures.Future:
        self._observed = True
        if self._future is None:
            futures = [c.future() for c in self._completions]
            if len(futures) == 1:
                self._future = futures[0]
            else:
                self._future = torch.futures.collect_all(futures).then(
                    lambda fut: [t for f in fut.value() for t in (f.value() or [])])
        return self._future

    def is_completed(self) -> bool:
        return all(c.poll() for c in self._completions)

    def is_success(self) -> bool:
        self._observed = True
        return self.is_completed() and all(c.error is None for c in self._completions)

    def exception(self):
        self._observed = True
        if not self.is_completed():
            return None
        return next((c.error for c in self._completions if c.error is not None), None)

    def result(self):
        self.wait()
        return [t for c in self._completions for t in (c.value or [])]

    def synchronize(self) -> None:
        self.wait()

    def source_rank(self) -> int:
        if self._source_rank_fn is None:
            raise RuntimeError("torchneuron: source_rank() is only defined for recv from any source")
        self.wait()
        return self._source_rank_fn()

    _source_rank = source_rank

    def __del__(self):
        # Dropped before anyone waited: finish on gloo's thread, so results still land in the
        # outputs, as they would on CUDA. A failure nobody can observe any more is not swallowed:
        # it is warned about, naming the collective (NCCL's watchdog reports the failures of works
        # nobody waits on, and tears the process down by default; gloo keeps them in the work).
        if getattr(self, "_observed", True):
            return
        for c in getattr(self, "_completions", ()):
            if c.done:
                _warn_unobserved(c)
                continue
            try:
                c.future().add_done_callback(lambda _fut, c=c: _warn_unobserved(c))
            except Exception as err:  # noqa: BLE001 - reported, not raised from a finaliser
                c.error = c.error or err
                _warn_unobserved(c)


def _warn_unobserved(c: _Completion) -> None:
    """The warning for a failed collective whose work was dropped before wait() (see __del__)."""
    if c.error is None:
        return
    message = str(c.error).splitlines()[0] if str(c.error) else type(c.error).__name__
    warnings.warn(f"torchneuron: {c.name} failed, and its Work was dropped without wait(), so nothing "
                  f"else reports it: {message}. Call wait() on the work a collective returns (or "
                  "pass async_op=False) to get the error where it happens.", CollectiveWarning,
                  stacklevel=2)


class CollectiveWarning(RuntimeWarning):
    """A collective failed where nobody waits for it (its Work was dropped)."""


def _combined_work(works: Sequence[NeuronWork]) -> NeuronWork:
    for w in works:
        w._observed = True   # the combined work reports their completions' errors
    return NeuronWork([c for w in works for c in w._completions])


def _reduce_op(op) -> tuple[ReduceOp, float | None]:
    """gloo's reduction for ``op``; PREMUL_SUM becomes a host-side scale then SUM."""
    red = op if isinstance(op, ReduceOp) else ReduceOp(op)
    if red.op == _RedOpType.PREMUL_SUM:
        factor = red.factor
        if not isinstance(factor, float | int):
            raise CollectiveError(
                "torchneuron: ReduceOp.PREMUL_SUM with a tensor factor is not supported by the neuron "
                "process group; scale the tensor first and use ReduceOp.SUM.")
        return _SUM, float(factor)
    return red, None


class ProcessGroupNeuron(dist.ProcessGroup):
    """The process group ``init_process_group("neuron")`` creates (see the module docstring)."""

    def __init__(self, store, rank: int, size: int, timeout: datetime.timedelta, group_name: str = "",
                 global_ranks: Sequence[int] = ()):
        super().__init__(rank, size)
        self._timeout = timeout
        self._gloo = ProcessGroupGloo(store, rank, size, timeout)
        self._gloo.options.global_ranks_in_group = list(global_ranks)
        self._gloo.options.group_name = group_name
        self._gloo._set_sequence_number_for_group()
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, self._gloo)
        # Neuron tensors: host copies over gloo, or DLPack-shared CUDA tensors over NCCL
        # (config.collectives; staging.transport says which).
        self._stage, self.engine_name = staging.transport(config.collectives, config.platform)
        self._engine = self._gloo if self.engine_name == "gloo" else _nccl(store, rank, size, timeout, group_name)
        self._coalesced: list[dist.Work] | None = None

    # -- identity -----------------------------------------------------------------------------
    def getBackendName(self) -> str:  # noqa: N802 - name c10d's trampoline calls
        return BACKEND_NAME

    def name(self) -> str:
        return BACKEND_NAME

    def _get_backend(self, device) -> dist.ProcessGroup:
        # gloo moves the bytes for every device; callers only ask it about capabilities
        # (splitting, tensor allocation, timeouts).
        return self._gloo

    def __repr__(self) -> str:
        return f"ProcessGroupNeuron(rank={self.rank()}, size={self.size()})"

    # -- the machinery shared by every collective ----------------------------------------------
    def _via(self, neuron: bool):
        """The engine that runs a collective: the transport's for neuron tensors, gloo for CPU ones."""
        return self._engine if neuron else self._gloo

    def _placement(self, name: str, tensors: Sequence[torch.Tensor]) -> bool:
        """True if the collective runs on neuron tensors, False for CPU tensors."""
        kinds = {t.device.type for t in tensors}
        if not kinds or kinds == {"cpu"}:
            return False
        if kinds == {"neuron"}:
            return True
        raise CollectiveError(
            f"torchneuron: {name} got tensors on {', '.join(sorted(str(t.device) for t in tensors))}; "
            "the neuron process group needs all of a collective's tensors on neuron or all on CPU. "
            "Move them with .to('neuron') or .cpu().")

    def _fail(self, name: str, tensors, err: BaseException, started: float) -> CollectiveError:
        message = str(err).strip()
        # gloo appends a generic paragraph after its first sentence; the first line says what broke.
        first = message.splitlines()[0] if message else type(err).__name__
        first = first.split(" This is typically caused by")[0].rstrip(". ")
        peer = any(s in message for s in ("Connection", "closed", "Timed out", "timed out", "reset",
                                          "Broken pipe", "peer"))
        hint = ("a peer process exited or stopped responding; look for the first failure in the other "
                "ranks' logs" if peer else "check that every rank calls the same collectives in the same "
                "order with matching shapes and dtypes")
        return CollectiveError(
            f"torchneuron: {name} of {staging.describe(tensors)} failed on rank {self.rank()} of "
            f"{self.size()} after {time.perf_counter() - started:.1f} s: {first}. Likely cause: {hint}. "
            f"The group's timeout is {self._timeout} (init_process_group(timeout=...)).")

    def _run(self, name: str, tensors: Sequence[torch.Tensor], nbytes: int, launch: Callable[[], object],
             finish: Callable[[], object], source_rank: bool = False) -> NeuronWork:
        """Launch a gloo collective and return a work that completes once ``finish`` has run."""
        started = time.perf_counter()
        try:
            work = launch()
        except Exception as err:
            if isinstance(err, CollectiveError):
                raise
            raise self._fail(name, tensors, err, started) from err

        def complete(err: BaseException | None):
            if err is not None:
                raise self._fail(name, tensors, err, started) from err
            self._stage.settle(work)
            value = finish()
            staging.flush()
            with _metrics_lock:
                metrics.collectives[name] += 1
                metrics.collective_bytes += nbytes
                metrics.collective_seconds += time.perf_counter() - started
            return value

        result = NeuronWork([_Completion(work, complete, name)],
                            source_rank=work._source_rank if source_rank else None)
        if self._coalesced is not None:
            self._coalesced.append(result)
        return result

    # -- all-reduce ---------------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        opts = opts or AllreduceOptions()
        name = "all_reduce"
        neuron = self._placement(name, tensors)
        red, factor = _reduce_op(opts.reduceOp)
        host = [self._stage.to_engine(t) for t in tensors] if neuron else list(tensors)
        if factor is not None:
            for h in host:
                h.mul_(factor)
        gopts = AllreduceOptions()
        gopts.reduceOp, gopts.timeout = red, opts.timeout

        def finish():
            if neuron:
                for t, h in zip(tensors, host):
                    self._stage.to_device(t, h)
            return list(tensors)
        return self._run(name, tensors, staging.nbytes(tensors), lambda: self._via(neuron).allreduce(host, gopts), finish)

    def allreduce_coalesced(self, tensors, opts=None):
        name = "all_reduce_coalesced"
        neuron = self._placement(name, tensors)
        red, factor = _reduce_op(opts.reduceOp if opts is not None else _SUM)
        gopts = AllreduceOptions()
        gopts.reduceOp = red
        if opts is not None:
            gopts.timeout = opts.timeout
        # One flat host buffer per dtype: one gloo all-reduce however many tensors DDP/FSDP pass.
        groups = self._stage.flatten_by_dtype(tensors) if neuron else None
        works = []
        if neuron:
            for flat, members in groups:
                if factor is not None:
                    flat.mul_(factor)

                def finish(flat=flat, members=members):
                    self._stage.unflatten_to_device(flat, members)
                    return [m for _, m, _ in members]
                works.append(self._run(name, [m for _, m, _ in members], flat.nbytes,
                                       lambda flat=flat: self._engine.allreduce([flat], gopts), finish))
        else:
            for t in tensors:
                if factor is not None:
                    t.mul_(factor)
                works.append(self._run(name, [t], staging.nbytes([t]),
                                       lambda t=t: self._gloo.allreduce([t], gopts), lambda t=t: [t]))
        return works[0] if len(works) == 1 else _combined_work(works)

    # -- broadcast / reduce --------------------------------------------------------------------
    def broadcast(self, tensors, opts=None):
        opts = opts or dist.BroadcastOptions()
        name = "broadcast"
        neuron = self._placement(name, tensors)
        root = self.rank() == opts.rootRank
        if neuron:
            host = [self._stage.to_engine(t) if root else self._stage.empty_like(t) for t in tensors]
        else:
            host = list(tensors)

        def finish():
            if neuron and not root:
                for t, h in zip(tensors, host):
                    self._stage.to_device(t, h)
            return list(tensors)
        return self._run(name, tensors, staging.nbytes(tensors), lambda: self._via(neuron).broadcast(host, opts), finish)

    def reduce(self, tensors, opts=None):
        opts = opts or dist.ReduceOptions()
        name = "reduce"
        neuron = self._placement(name, tensors)
        red, factor = _reduce_op(opts.reduceOp)
        host = [self._stage.to_engine(t) for t in tensors] if neuron else list(tensors)
        if factor is not None:
            for h in host:
                h.mul_(factor)
        gopts = dist.ReduceOptions()
        gopts.reduceOp, gopts.rootRank, gopts.rootTensor, gopts.timeout = red, opts.rootRank, opts.rootTensor, opts.timeout
        root = self.rank() == opts.rootRank

        def finish():
            if neuron and root:
                for t, h in zip(tensors, host):
                    self._stage.to_device(t, h)
            return list(tensors)
        return self._run(name, tensors, staging.nbytes(tensors), lambda: self._via(neuron).reduce(host, gopts), finish)

    # -- all-gather ----------------------------------------------------------------------------
    def allgather(self, output_tensors, input_tensors, opts=None):
        opts = opts or AllgatherOptions()
        name = "all_gather"
        flat_out = [t for row in output_tensors for t in row]
        neuron = self._placement(name, list(input_tensors) + flat_out)
        if neuron:
            host_in = [self._stage.to_engine(t) for t in input_tensors]
            host_out = [[self._stage.empty_like(t) for t in row] for row in output_tensors]
        else:
            host_in, host_out = input_tensors, output_tensors

        def finish():
            if neuron:
                for row, hrow in zip(output_tensors, host_out):
                    for t, h in zip(row, hrow):
                        self._stage.to_device(t, h)
            return output_tensors
        return self._run(name, flat_out, staging.nbytes(flat_out),
                         lambda: self._via(neuron).allgather(host_out, host_in, opts), finish)

    def all_gather_single(self, output, input, opts=None):
        opts = opts or AllgatherOptions()
        name = "all_gather_into_tensor"
        neuron = self._placement(name, [output, input])
        host_in = self._stage.to_engine(input) if neuron else input
        host_out = self._stage.empty_like(output) if neuron else output

        def finish():
            if neuron:
                self._stage.to_device(output, host_out)
            return [output]
        return self._run(name, [output], staging.nbytes([output]),
                         lambda: self._via(neuron)._allgather_base(host_out, host_in, opts), finish)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        opts = opts or AllgatherOptions()
        name = "all_gather_into_tensor_coalesced"
        neuron = self._placement(name, list(outputs) + list(inputs))
        if not neuron:
            works = [self._run(name, [o], staging.nbytes([o]),
                               lambda o=o, i=i: self._gloo._allgather_base(o, i, opts), lambda o=o: [o])
                     for o, i in zip(outputs, inputs)]
            return works[0] if len(works) == 1 else _combined_work(works)
        # Inputs of one dtype travel as one buffer; rank r's block of the result holds every
        # input's r-th shard, which is copied into the matching slice of each output.
        works = []
        size = self.size()
        for flat, members in self._stage.flatten_by_dtype(inputs):
            gathered = self._stage.buffer((size * flat.numel(),), flat.dtype, inputs[0].device.index or 0)
            outs = [outputs[i] for i, _, _ in members]

            def finish(gathered=gathered, members=members, outs=outs):
                blocks = gathered.view(size, -1)
                for out, (_, _, (start, numel)) in zip(outs, members):
                    self._stage.to_device(out, blocks[:, start:start + numel].reshape(out.shape))
                return outs
            works.append(self._run(name, outs, gathered.nbytes,
                                   lambda g=gathered, f=flat: self._engine._allgather_base(g, f, opts), finish))
        return works[0] if len(works) == 1 else _combined_work(works)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        # output_lists[r][j] receives rank r's input j: one all-gather per input.
        opts = opts or AllgatherOptions()
        works = [self.allgather([[row[j] for row in output_lists]], [inp], opts) for j, inp in enumerate(input_list)]
        return works[0] if len(works) == 1 else _combined_work(works)

    # -- reduce-scatter ------------------------------------------------------------------------
    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        opts = opts or ReduceScatterOptions()
        name = "reduce_scatter"
        flat_in = [t for row in input_tensors for t in row]
        neuron = self._placement(name, list(output_tensors) + flat_in)
        red, factor = _reduce_op(opts.reduceOp)
        if neuron:
            host_in = [[self._stage.to_engine(t) for t in row] for row in input_tensors]
            host_out = [self._stage.empty_like(t) for t in output_tensors]
        else:
            host_in = [[t.clone() for t in row] for row in input_tensors] if factor is not None else input_tensors
            host_out = output_tensors
        if factor is not None:
            for row in host_in:
                for h in row:
                    h.mul_(factor)
        gopts = ReduceScatterOptions()
        gopts.reduceOp, gopts.timeout = red, opts.timeout

        def finish():
            if neuron:
                for t, h in zip(output_tensors, host_out):
                    self._stage.to_device(t, h)
            return list(output_tensors)
        return self._run(name, list(output_tensors), staging.nbytes(flat_in),
                         lambda: self._via(neuron).reduce_scatter(host_out, host_in, gopts), finish)

    def reduce_scatter_single(self, output, input, opts=None):
        opts = opts or ReduceScatterOptions()
        name = "reduce_scatter_tensor"
        neuron = self._placement(name, [output, input])
        red, factor = _reduce_op(opts.reduceOp)
        if neuron:
            host_in, host_out = self._stage.to_engine(input), self._stage.empty_like(output)
        else:
            host_in = input.clone() if factor is not None else input
            host_out = output
        if factor is not None:
            host_in.mul_(factor)
        gopts = ReduceScatterOptions()
        gopts.reduceOp, gopts.timeout = red, opts.timeout

        def finish():
            if neuron:
                self._stage.to_device(output, host_out)
            return [output]
        return self._run(name, [output], staging.nbytes([input]),
                         lambda: self._via(neuron)._reduce_scatter_base(host_out, host_in, gopts), finish)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        opts = opts or ReduceScatterOptions()
        name = "reduce_scatter_tensor_coalesced"
        neuron = self._placement(name, list(outputs) + list(inputs))
        if not neuron:
            works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)]
            return works[0] if len(works) == 1 else _combined_work(works)
        red, factor = _reduce_op(opts.reduceOp)
        gopts = ReduceScatterOptions()
        gopts.reduceOp, gopts.timeout = red, opts.timeout
        size = self.size()
        works = []
        # Per dtype, one buffer whose r-th block holds every input's r-th shard: one gloo op.
        for flat, members in self._stage.flatten_by_dtype(inputs, blocks=size):
            if factor is not None:
                flat.mul_(factor)
            shard = self._stage.buffer((flat.numel() // size,), flat.dtype, inputs[0].device.index or 0)
            outs = [outputs[i] for i, _, _ in members]

            def finish(shard=shard, members=members, outs=outs):
                for out, (_, _, (start, numel)) in zip(outs, members):
                    self._stage.to_device(out, shard[start // size:(start + numel) // size].view(out.shape))
                return outs
            works.append(self._run(name, outs, flat.nbytes,
                                   lambda s=shard, f=flat: self._engine._reduce_scatter_base(s, f, gopts), finish))
        return works[0] if len(works) == 1 else _combined_work(works)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # -- all-to-all ----------------------------------------------------------------------------
    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        opts = opts or dist.AllToAllOptions()
        name = "all_to_all_single"
        neuron = self._placement(name, [output, input])
        host_in = self._stage.to_engine(input) if neuron else input
        host_out = self._stage.empty_like(output) if neuron else output
        out_splits, in_splits = list(output_split_sizes), list(input_split_sizes)

        def finish():
            if neuron:
                self._stage.to_device(output, host_out)
            return [output]
        return self._run(name, [output, input], max(staging.nbytes([output]), staging.nbytes([input])),
                         lambda: self._via(neuron).alltoall_base(host_out, host_in, out_splits, in_splits, opts), finish)

    alltoall_base = all_to_all_single

    def alltoall(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.AllToAllOptions()
        name = "all_to_all"
        neuron = self._placement(name, list(output_tensors) + list(input_tensors))
        if neuron:
            host_in = [self._stage.to_engine(t) for t in input_tensors]
            host_out = [self._stage.empty_like(t) for t in output_tensors]
        else:
            host_in, host_out = input_tensors, output_tensors

        def finish():
            if neuron:
                for t, h in zip(output_tensors, host_out):
                    self._stage.to_device(t, h)
            return list(output_tensors)
        return self._run(name, list(output_tensors), max(staging.nbytes(output_tensors), staging.nbytes(input_tensors)),
                         lambda: self._via(neuron).alltoall(host_out, host_in, opts), finish)

    # -- gather / scatter ----------------------------------------------------------------------
    def gather(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.GatherOptions()
        name = "gather"
        flat_out = [t for row in output_tensors for t in row]
        neuron = self._placement(name, list(input_tensors) + flat_out)
        if neuron:
            host_in = [self._stage.to_engine(t) for t in input_tensors]
            host_out = [[self._stage.empty_like(t) for t in row] for row in output_tensors]
        else:
            host_in, host_out = input_tensors, output_tensors

        def finish():
            if neuron:
                for row, hrow in zip(output_tensors, host_out):
                    for t, h in zip(row, hrow):
                        self._stage.to_device(t, h)
            return output_tensors
        return self._run(name, list(input_tensors), max(staging.nbytes(flat_out), staging.nbytes(input_tensors)),
                         lambda: self._via(neuron).gather(host_out, host_in, opts), finish)

    def scatter(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.ScatterOptions()
        name = "scatter"
        flat_in = [t for row in input_tensors for t in row]
        neuron = self._placement(name, list(output_tensors) + flat_in)
        if neuron:
            host_in = [[self._stage.to_engine(t) for t in row] for row in input_tensors]
            host_out = [self._stage.empty_like(t) for t in output_tensors]
        else:
            host_in, host_out = input_tensors, output_tensors

        def finish():
            if neuron:
                for t, h in zip(output_tensors, host_out):
                    self._stage.to_device(t, h)
            return list(output_tensors)
        return self._run(name, list(output_tensors), max(staging.nbytes(flat_in), staging.nbytes(output_tensors)),
                         lambda: self._via(neuron).scatter(host_out, host_in, opts), finish)

    # -- barrier and point-to-point ------------------------------------------------------------
    def barrier(self, opts=None):
        opts = opts or dist.BarrierOptions()
        staging.flush()
        return self._run("barrier", [], 0, lambda: self._gloo.barrier(opts), lambda: [])

    def send(self, tensors, dst_rank, tag=0):
        name = "send"
        neuron = self._placement(name, tensors)
        host = [self._stage.to_engine(t) for t in tensors] if neuron else list(tensors)
        return self._run(name, tensors, staging.nbytes(tensors), lambda: self._via(neuron).send(host, dst_rank, tag),
                         lambda: list(tensors))

    def _recv(self, tensors, launch, anysource):
        name = "recv"
        neuron = self._placement(name, tensors)
        host = [self._stage.empty_like(t) for t in tensors] if neuron else list(tensors)

        def finish():
            if neuron:
                for t, h in zip(tensors, host):
                    self._stage.to_device(t, h)
            return list(tensors)
        return self._run(name, tensors, staging.nbytes(tensors), lambda: launch(self._via(neuron), host), finish,
                         source_rank=anysource)

    def recv(self, tensors, src_rank, tag=0):
        return self._recv(tensors, lambda engine, host: engine.recv(host, src_rank, tag), anysource=False)

    def recv_anysource(self, tensors, tag=0):
        return self._recv(tensors, lambda engine, host: engine.recv_anysource(host, tag), anysource=True)

    # -- coalescing (``_coalescing_manager(device=...)``) ---------------------------------------
    def _start_coalescing(self, device=None) -> None:
        if self._coalesced is not None:
            raise CollectiveError("torchneuron: _coalescing_manager blocks on one process group cannot nest")
        self._coalesced = []

    def _end_coalescing(self, device=None) -> NeuronWork:
        works, self._coalesced = self._coalesced or [], None
        return _combined_work(works)


def _nccl(store, rank: int, size: int, timeout: datetime.timedelta, group_name: str):
    """PyTorch's NCCL process group over the same rendezvous (its keys under their own prefix)."""
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(dist.PrefixStore(f"neuron-nccl/{group_name}/", store), rank, size, options)


def create(backend_opts, pg_options=None) -> ProcessGroupNeuron:
    """The creator c10d calls (``extended_api=True``) for every group using the ``neuron`` backend."""
    return ProcessGroupNeuron(backend_opts.store, backend_opts.group_rank, backend_opts.group_size,
                              backend_opts.timeout, backend_opts.group_id,
                              list(backend_opts.global_ranks_in_group))
