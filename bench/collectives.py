"""Collective bandwidth: neuron tensors through the ``neuron`` backend vs CPU tensors through gloo.

    torchrun --nproc-per-node 2 bench/collectives.py [--min-kib 4] [--max-mib 64] [--trials 15]

Both sides run in the same processes. "gloo" is a plain gloo group (``new_group(backend="gloo")``)
moving CPU tensors: the ceiling for the neuron backend, which stages through host memory and hands
the bytes to gloo. Each trial times the two sides back to back (alternating which goes first), so a
shared machine's load hits both alike; the ratio column is the median over trials of gloo time /
neuron time (1.00x = no staging overhead). Bandwidth is algorithm bandwidth: payload bytes (the
all-reduced tensor, the gathered output) / median time per call.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist


def _time_per_call(fn, iters: int, sync) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - start) / iters


def _calls(op: str, numel: int, world: int, gloo):
    """(gloo call on CPU tensors, neuron call through the default group, payload bytes) for one size."""
    cpu = torch.ones(numel)
    dev = torch.ones(numel, device="neuron")
    if op == "all_reduce":
        return (lambda: dist.all_reduce(cpu, group=gloo)), (lambda: dist.all_reduce(dev)), cpu.nbytes
    if op == "all_gather":
        cpu_out = torch.empty(numel * world)
        dev_out = torch.empty(numel * world, device="neuron")
        return ((lambda: dist.all_gather_into_tensor(cpu_out, cpu, group=gloo)),
                (lambda: dist.all_gather_into_tensor(dev_out, dev)), cpu_out.nbytes)
    raise SystemExit(f"unknown op {op!r}: use all_reduce or all_gather")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min-kib", type=int, default=4)
    parser.add_argument("--max-mib", type=int, default=64)
    parser.add_argument("--trials", type=int, default=15, help="timed pairs of trials per size")
    parser.add_argument("--ops", default="all_reduce,all_gather")
    parser.add_argument("--verbose", action="store_true", help="print each size as it is measured")
    args = parser.parse_args()

    import torchneuron
    dist.init_process_group("neuron")
    rank, world = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    neuron_sync = torch.neuron.synchronize

    sizes = []
    n = args.min_kib * 1024
    while n <= args.max_mib * 1024 * 1024:
        sizes.append(n)
        n *= 4

    rows = []
    for op in args.ops.split(","):
        for nbytes in sizes:
            run_cpu, run_dev, payload = _calls(op, nbytes // 4, world, gloo)
            # Enough calls per trial to run ~0.1 s at gloo speed; the first calls compile and warm up.
            for _ in range(3):
                run_cpu()
                run_dev()
            neuron_sync()
            probe = _time_per_call(run_cpu, 3, lambda: None)
            # Every rank must run the same number of calls: rank 0's estimate decides.
            count = torch.tensor([max(3, min(100, int(0.1 / max(probe, 1e-6))))])
            dist.broadcast(count, 0, group=gloo)
            iters = int(count)
            t_cpu, t_dev = [], []
            for trial in range(args.trials):
                # Back-to-back pairs, alternating which side goes first, so both see the same load.
                first, second = (run_cpu, run_dev) if trial % 2 == 0 else (run_dev, run_cpu)
                a = _time_per_call(first, iters, neuron_sync)
                b = _time_per_call(second, iters, neuron_sync)
                t_cpu.append(a if first is run_cpu else b)
                t_dev.append(b if first is run_cpu else a)
            # Every rank must agree on the figures: take the slowest rank's.
            ratios = [c / d for c, d in zip(t_cpu, t_dev)]
            stats = torch.tensor([statistics.median(t_cpu), statistics.median(t_dev), statistics.median(ratios)],
                                 dtype=torch.float64)
            dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=gloo)
            rows.append((op, nbytes, payload, *(float(x) for x in stats)))
            if rank == 0 and args.verbose:
                print(f"{op} {nbytes} B: gloo {stats[0] * 1e3:.3f} ms, neuron {stats[1] * 1e3:.3f} ms, "
                      f"ratio {stats[2]:.2f} (medians; {iters} calls x {args.trials} trials)", flush=True)

    if rank == 0:
        print(f"world size {world}, torch {torch.__version__}, torchneuron {torchneuron.__version__}, "
              f"platform {torchneuron.config.platform}, {args.trials} trials per size")
        print("| op | size | gloo CPU GB/s | neuron GB/s | neuron / gloo |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for op, nbytes, payload, tc, td, ratio in rows:
            size = f"{nbytes // 1024} KiB" if nbytes < 1 << 20 else f"{nbytes >> 20} MiB"
            print(f"| {op} | {size} | {payload / tc / 1e9:.3f} | {payload / td / 1e9:.3f} | {ratio:.2f}x |")
        m = torchneuron.metrics()
        print(f"\nneuron collectives counted: {sum(m['collectives'].values())}, "
              f"{m['collective_bytes'] / 1e9:.2f} GB, {m['collective_seconds']:.1f} s")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
