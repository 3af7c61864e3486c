"""Plain-torch reproducer: heap corruption when a Gloo sparse all-reduce completes
beside another collective of the same ProcessGroupGloo (pyreducer is not involved).

The race. In torch/csrc/distributed/c10d/ProcessGroupGloo.cpp, ProcessGroupGloo::runLoop
(about lines 692-723 in recent versions) runs on each of the group's worker threads
(Options::threads, 2 by default). After `AsyncWork::execute(work)`, with workMutex_
released, each thread runs
    pgStatus_->lastCompletedSeq = ...;
    pgStatus_->lastCompletedWorkName = opTypeToString(work->opType_);
pgStatus_ is one ProcessGroupStatus per ProcessGroupGloo instance, so two worker threads
can assign the same std::string at the same time. A name longer than libstdc++'s
15-char inline buffer lives on the heap. A move-assignment gives the old buffer to the
temporary, which frees it. So two threads can free that buffer twice, or one can copy
"ALLREDUCE" into it after the other freed it. A sparse all-reduce records
"_ALLREDUCE_SPARSE" (17 chars). This came with the Gloo flight recorder (pytorch PR
#152614). The runLoop of 2.7.1 has no such assignment; the 2.8.0 to 2.15.0 binaries all
make it with no lock held. Work.wait() returns before the worker thread assigns the
string, so --serialize only narrows the window. --single-thread-group closes it.

Run it from the repo root (--help lists every option):
    .venv/bin/python tests/upstream/gloo_sparse_race.py                   # races
    .venv/bin/python tests/upstream/gloo_sparse_race.py --single-thread-group
    .venv/bin/python tests/upstream/gloo_sparse_race.py --serialize
The script exits 1 if any rank died by a signal or printed a heap/ASan error.

What it printed here (2 cores, 3 ranks, default options; ~25 s per 1000 iters, ~45 s mitigated):
  torch 2.13.0+cpu, same group: 3/3 runs crashed (SIGSEGV x2, SIGBUS; 27-70 s in)
      earlier tuning runs: 2/2 crashed; with --pairs 2 --nnz 64 --cols 16: 1/3 of 5000 iters
      LD_PRELOAD=libasan.so.8: "heap-use-after-free ... WRITE of size 9 ... in
      ProcessGroupGloo::runLoop", freed by the other worker thread in runLoop
  torch 2.11.0 / 2.12.1 / 2.14.1 (PyPI cu130 wheels, run on CPU), same group:
      1/2, 2/2 and 2/2 runs crashed (SIGSEGV), 20-70 s into a run
  --single-thread-group: 0/2 runs x 5000 iters, 0/1 x 3000 under ASan (2.13);
                         0/1 x 3000 (2.14.1)
  --serialize:           0/2 runs x 5000 iters, 0/1 x 3000 under ASan (2.13)
"""
import argparse, os, signal, subprocess, sys, tempfile, time
from datetime import timedelta

HEAP_MARKERS = ("free(", "malloc", "corrupt", "AddressSanitizer", "Fatal Python error")


def worker(a, rank):
    import faulthandler, torch, torch.distributed as dist
    from torch.distributed import ProcessGroupGloo
    faulthandler.enable()  # prints "Fatal Python error: Segmentation fault" before dying
    dist.init_process_group("gloo", init_method=a.init, rank=rank, world_size=a.ranks,
                            timeout=timedelta(seconds=60))
    if a.single_thread_group:
        # dist.new_group(..., pg_options=opts) ignores Gloo options (2.8-2.15: it always
        # gets 2 threads), so build the backend directly on a prefixed default store.
        opts = ProcessGroupGloo._Options()
        opts._threads = 1
        opts._devices = [ProcessGroupGloo.create_default_device()]  # required
        opts._timeout = timedelta(seconds=60)
        store = dist.PrefixStore("sparse_1thread/", dist.distributed_c10d._get_default_store())
        sparse_pg = ProcessGroupGloo(store, rank, a.ranks, opts)  # collective: all ranks
        sparse_allreduce = lambda t: sparse_pg.allreduce([t])
    else:
        sparse_allreduce = lambda t: dist.all_reduce(t, async_op=True)
    g = torch.Generator().manual_seed(1234 + rank)
    dense = [torch.ones(a.dense_numel) for _ in range(a.pairs)]
    t0 = time.time()
    for it in range(1, a.iters + 1):
        sparse = [torch.sparse_coo_tensor(torch.randint(0, a.rows, (1, a.nnz), generator=g),
                                          torch.randn(a.nnz, a.cols, generator=g),
                                          (a.rows, a.cols), check_invariants=True)
                  for _ in range(a.pairs)]
        if a.serialize:  # never more than one collective in flight
            for s, d in zip(sparse, dense):
                dist.all_reduce(d, async_op=True).wait()
                sparse_allreduce(s).wait()
        else:  # all the sparse and dense all-reduces in flight together
            works = []
            for s, d in zip(sparse, dense):
                works += [sparse_allreduce(s), dist.all_reduce(d, async_op=True)]
            for w in works:
                w.wait()
        if rank == 0 and (it % a.report == 0 or it == a.iters):
            print(f"    iter {it}/{a.iters}  {time.time() - t0:.1f}s", flush=True)
    dist.destroy_process_group()


def run_once(a):
    """Runs the ranks once; returns (crashed, [(rank, what, first heap/last log line)])."""
    tmp = tempfile.mkdtemp(prefix="gloo_sparse_race_")
    logs = [open(os.path.join(tmp, f"rank{r}.log"), "w+") for r in range(a.ranks)]
    procs = [subprocess.Popen([sys.executable, __file__, *sys.argv[1:], "--worker", str(r),
                               "--init", f"file://{tmp}/store"],
                              stdout=None if r == 0 else logs[r], stderr=logs[r])
             for r in range(a.ranks)]  # rank 0 prints its progress to our stdout
    deadline, first_fail, killed = time.time() + a.timeout, None, set()
    while any(p.poll() is None for p in procs):
        if first_fail is None and any(p.returncode not in (None, 0) for p in procs):
            first_fail = time.time()  # the others now block in a collective or error out
        if time.time() > deadline or (first_fail and time.time() - first_fail > 5):
            for r, p in enumerate(procs):
                if p.poll() is None:
                    p.kill()
                    killed.add(r)
        time.sleep(0.05)
    crashed, report = False, []
    for r, (p, log) in enumerate(zip(procs, logs)):
        log.seek(0)
        lines = [l for l in log.read().splitlines() if l.strip()]
        heap = [l for l in lines if any(k in l for k in HEAP_MARKERS)]
        rc = p.returncode
        what = ("killed by this script" if r in killed else
                f"died with {signal.Signals(-rc).name}" if rc < 0 else
                f"exited {rc}" if rc else "exited 0")
        crashed |= bool(heap) or (rc < 0 and r not in killed)
        if rc or heap:
            report.append((r, what, heap[0] if heap else (lines[-1] if lines else "")))
    return crashed, report


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=3)
    p.add_argument("--iters", type=int, default=3000, help="iterations per run")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--pairs", type=int, default=4,
                   help="sparse+dense all-reduce pairs in flight per iteration")
    p.add_argument("--rows", type=int, default=1000, help="sparse tensor rows")
    p.add_argument("--cols", type=int, default=4, help="sparse tensor columns")
    p.add_argument("--nnz", type=int, default=8, help="sparse rows per rank")
    p.add_argument("--dense-numel", type=int, default=16)
    p.add_argument("--single-thread-group", action="store_true",
                   help="sparse all-reduces on a separate 1-worker-thread Gloo group")
    p.add_argument("--serialize", action="store_true",
                   help="wait for each collective before launching the next")
    p.add_argument("--report", type=int, default=500, help="progress every N iterations")
    p.add_argument("--timeout", type=float, default=900, help="seconds per run")
    p.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    p.add_argument("--init", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker is not None:
        return worker(a, a.worker)
    import torch
    mode = ("sparse on a 1-thread group" if a.single_thread_group else
            "serialized" if a.serialize else "concurrent on one group")
    print(f"torch {torch.__version__}: {a.ranks} ranks, {a.runs} runs x {a.iters} iters, "
          f"{a.pairs} sparse+dense pair(s) per iter, {mode}", flush=True)
    crashes = errors = 0
    for run in range(1, a.runs + 1):
        t0 = time.time()
        print(f"run {run}/{a.runs}", flush=True)
        crashed, report = run_once(a)
        crashes += crashed
        errors += bool(report) and not crashed
        status = "CRASH" if crashed else "ERROR" if report else "OK"
        print(f"run {run}: {status} after {time.time() - t0:.1f}s", flush=True)
        for r, what, line in report:
            print(f"    rank {r}: {what}   {line[:140]}", flush=True)
    print(f"summary: {crashes}/{a.runs} runs crashed, {errors} other errors "
          f"(torch {torch.__version__}, {mode})")
    return 1 if crashes else 2 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
