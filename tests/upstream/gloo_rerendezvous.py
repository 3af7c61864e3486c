"""Plain torch (no pyreducer): Gloo's rendezvous in a re-created process group.

tests/multirank/test_recreate.py's pattern without pyreducer: 2 ranks spawned as run_ranks does
("spawn", 1 thread, first init over a file:// store, 60 s timeout); per generation two torch DDP
wrappers (the test trains torch's and pyreducer's) on a small nn.Sequential, SGD, --steps steps,
an allreduce comm hook every third generation, then barrier, destroy_process_group, gc.collect,
init_process_group over a fresh file:// store. Does connectFullMesh fail with torch alone?

    .venv/bin/python tests/upstream/gloo_rerendezvous.py --runs 300 [--generations 6] [--ranks 2]
        [--steps 3] [--no-barrier] [--sleep S] [--no-hook] [--max-minutes M]

Measured (torch 2.13.0+cpu, 2 cores shared with another test loop): defaults: 3 of 161 runs
failed (~3 of 966 re-created groups), each "Gloo connectFullMesh failed with [.../tcp/pair.cc:553]
Connection closed by peer [127.0.0.1]:26765" (40151, 43180): test_recreate's failure, torch
alone. Gloo prints sin_port unconverted: 36200, 55196, 44200, even ports, i.e. connect() source
ports (listeners get odd ones): the failing rank was the pair's listening side, and the
initiator's socket closed after connecting. --generations 30 --steps 1: 0 of 28 runs (840 groups).
"""
import argparse
import gc
import multiprocessing as mp
import os
import queue
import sys
import tempfile
import time
import traceback
from datetime import timedelta


def worker(rank, world_size, init_file, store_dir, opts, results):
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    status, payload, g = "ok", None, "initial"
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=60))
        caps = [dict(bucket_cap_mb=0.001), dict(static_graph=True), dict(bucket_cap_mb=0.002)]
        for g in range(opts.generations):
            torch.manual_seed(g + 10 * rank)
            gen = torch.Generator().manual_seed(rank)
            for _ in range(2):  # the test trains two wrappers per generation
                model = DDP(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16)),
                            **caps[g % 3])
                if g % 3 == 1 and not opts.no_hook:
                    model.register_comm_hook(None, default_hooks.allreduce_hook)
                opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=False)
                for _ in range(opts.steps):
                    opt.zero_grad()
                    model(torch.randn(8, 16, generator=gen)).pow(2).mean().backward()
                    opt.step()
                del model, opt
            if not opts.no_barrier:
                dist.barrier()
            dist.destroy_process_group()
            gc.collect()
            time.sleep(opts.sleep)
            dist.init_process_group("gloo", init_method=f"file://{store_dir}/store{g}",
                                    rank=rank, world_size=world_size)
    except BaseException:  # noqa: BLE001 - reported to the parent
        status, payload = "error", f"(generation {g}) {traceback.format_exc()}"
    results.put((rank, status, payload))
    results.close()
    results.join_thread()
    if status == "ok" and dist.is_initialized():
        dist.destroy_process_group()
    os._exit(0 if status == "ok" else 1)


def one_run(opts, timeout_s=120):
    """None if every rank finished, else the errors of the ranks that failed."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="gloo-rerdv-") as tmp:
        procs = [ctx.Process(target=worker, daemon=True,
                             args=(r, opts.ranks, f"{tmp}/init", tmp, opts, results))
                 for r in range(opts.ranks)]
        for p in procs:
            p.start()
        outcomes, deadline = {}, time.monotonic() + timeout_s
        while len(outcomes) < opts.ranks and time.monotonic() < deadline:
            try:
                rank, status, payload = results.get(timeout=0.5)
                outcomes[rank] = (status, payload)
            except queue.Empty:
                if all(p.exitcode is not None for p in procs):  # all gone, nothing more
                    break
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    errors = [f"rank {r}: {payload}" for r, (s, payload) in outcomes.items() if s == "error"]
    errors += [f"rank {r}: no report (exit code {procs[r].exitcode})"
               for r in range(opts.ranks) if r not in outcomes]
    return "\n".join(errors) or None


def main():
    ap = argparse.ArgumentParser()
    for flag, kind, default in [("--runs", int, 100), ("--generations", int, 6),
                                ("--ranks", int, 2), ("--steps", int, 3),
                                ("--sleep", float, 0.0), ("--max-minutes", float, 25.0)]:
        ap.add_argument(flag, type=kind, default=default)
    ap.add_argument("--no-barrier", action="store_true")
    ap.add_argument("--no-hook", action="store_true")
    opts = ap.parse_args()
    failures, start, n = [], time.monotonic(), 0
    while n < opts.runs and time.monotonic() - start < 60 * opts.max_minutes:
        n += 1
        error = one_run(opts)
        if error:
            failures.append((n, error))
        if error or n % 10 == 0:
            print(f"run {n}: {len(failures)} failed so far ({time.monotonic() - start:.0f} s)"
                  + (f" <- {error.strip().splitlines()[-1]}" if error else ""), flush=True)
    print(f"\n{len(failures)} of {n} runs failed ({vars(opts)})")
    for run, error in failures:  # per rank: "rank r: (generation g) Traceback", the errors
        lines = [line for line in error.splitlines() if line.startswith("rank") or "Error" in line]
        print(f"--- run {run}:\n  " + "\n  ".join(lines[:8]))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
