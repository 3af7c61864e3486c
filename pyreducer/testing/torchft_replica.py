"""One torchft replica group (one process) of a fault-tolerance test or benchmark
(pyreducer/testing/torchft_job.py starts them): `python -m pyreducer.testing.torchft_replica
CONFIG_JSON`.

It trains a small MLP with torchft's protocol (start_quorum, forward, backward, should_commit,
step) under pyreducer's torchft wrapper or torchft's own DDP, until the Manager's step reaches
`steps`, and writes to `out` (torch.save) its parameters and, per attempted step, what it saw:
the step, the participants, whether it participated (False: healing), whether it committed,
its loss. A first life (attempt 0) may fail on purpose at step `fail_step`:
  - "leave": exits before that step's quorum;
  - "exit" / "sigkill": os._exit / SIGKILL from the first layer's gradient hook, so that the
    other buckets' all-reduces are in flight (the first layer's bucket is launched last);
  - "sigstop": stops itself there (the job kills it later).
Each replica's batch at step s depends on (replica, s) alone, so a replay of the logged schedule
can recompute the expected parameters (torchft_job.replay).

Optional config keys (absent: the tests' loopback job): "model" (a MODELS name; default
"small"), "host" (this replica's address, for its store and Manager, on emulated hosts; default
"localhost"), "barrier" ({"dir", "count", "timeout_s"}: a first life waits, its Manager already
heartbeating, until `count` replicas have reached the loop, so that a job starts with all of
them in its first quorum rather than healing the late ones in), "plan" ("torchft": pyreducer's
wrapper gets torchft's own DDP's buckets, torchft_plan), "await_rejoin" (seconds: after a step
that was not committed, and in a restarted life, a replica sleeps that long after each step,
and trains past `steps` if need be, until a committed step has had every replica in it, as
every replica logged it (_all_back): the restarted replica rejoins the survivor, whatever its
restart takes, instead of training alone after the survivor is done), "accumulate"
(micro-batches a step, all but the last under no_sync()), "edges" (pyreducer's wrapper: before
the first quorum and after the last should_commit(), a forward with grad on, then its backward;
what each did goes into the output's "edges": Note [One quorum, one backward] in
pyreducer/torchft.py).
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

WIDTH = 64
# name -> (inputs, width, hidden width x width layers, outputs, batch per replica)
MODELS = {
    "small": (16, WIDTH, 2, 4, 8),  # the tests' (parameters: 9.6 KiB)
    # benchmarks/bench_torchft.py's: 16.1 MiB of gradients (4.2 M parameters), ~0.2 s of ring
    # all-reduce among 3 hosts at 1 Gbit/s, ~70 ms of compute per step at batch 256, 1 thread
    "mlp_16mb": (1024, 1024, 3, 16, 256),
}


def build_model(model: str = "small") -> nn.Module:
    """The replicas' model (the same initial weights everywhere; healing syncs them anyway)."""
    inputs, width, hidden, outputs, _ = MODELS[model]
    torch.manual_seed(0)
    layers = [nn.Linear(inputs, width)]
    for _ in range(hidden):
        layers += [nn.ReLU(), nn.Linear(width, width)]
    return nn.Sequential(*layers, nn.ReLU(), nn.Linear(width, outputs))


def batch(replica: int, step: int, model: str = "small") -> tuple[torch.Tensor, torch.Tensor]:
    inputs, _, _, outputs, size = MODELS[model]
    gen = torch.Generator().manual_seed(1000 * replica + step)
    return torch.randn(size, inputs, generator=gen), torch.randn(size, outputs, generator=gen)


def torchft_plan(model: nn.Module, bucket_cap_mb: float) -> list[list[str]]:
    """The buckets of torchft's own DDP (torch DDP's first-iteration plan of the
    unused-parameter search, never rebuilt), by parameter name: given to pyreducer's wrapper as
    `bucket_plan=`, its all-reduces sum as torchft's do, bit for bit at any replica count."""
    from pyreducer.wrapper import bucketing

    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    plan = bucketing.initial_plan([p.numel() * p.element_size() for _, p in named],
                                  [f"{p.device}:{p.dtype}" for _, p in named],
                                  bucketing.caps_bytes(bucket_cap_mb, None), one_bucket=False)
    return [[named[i][0] for i in bucket] for bucket in plan]


def build_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _fail_now(kind: str) -> None:
    if kind == "exit":
        os._exit(3)
    os.kill(os.getpid(), signal.SIGKILL if kind == "sigkill" else signal.SIGSTOP)


def train_step(manager, ddp, optimizer, replica: int, model: str, accumulate: int = 1) -> dict:
    """One step of torchft's protocol; what it saw, and when each phase ended (time.time()).
    accumulate > 1: as many micro-batches, all but the last under ddp.no_sync()."""
    started = time.time()
    manager.start_quorum()
    optimizer.zero_grad()
    for micro in range(1, accumulate):
        with ddp.no_sync():
            x, y = batch(replica + 100 * micro, manager.current_step(), model)
            F.mse_loss(ddp(x), y).backward()
    x, y = batch(replica, manager.current_step(), model)
    loss = F.mse_loss(ddp(x), y)
    forward_end = time.time()  # with the quorum awaited (pyreducer's wrapper)
    loss.backward()
    backward_end = time.time()  # every bucket reduced
    # after the quorum: a healing replica's step is its peers' (its batch was not used)
    step, participants = manager.current_step(), manager.num_participants()
    participating = manager.is_participating()
    quorum = manager._quorum_id  # (torchft 0.2 has no public accessor) which attempt at `step`
    committed = manager.should_commit()
    commit_end = time.time()
    if committed:
        optimizer.step()
    return dict(step=step, quorum=quorum, participants=participants,
                participating=participating, committed=committed, loss=loss.item(),
                start=started, forward_end=forward_end, backward_end=backward_end,
                commit_end=commit_end, end=time.time())


def _manager(config: dict, pg, holder: dict):
    """This replica group's Manager (its store and Manager server on config's host)."""
    import torchft
    from torchft.checkpointing.pg_transport import PGTransport

    host = config.get("host", "localhost")
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
    holder["store"] = store  # kept alive with the Manager

    def load_state_dict(state):
        holder["model"].module.load_state_dict(state["model"])
        holder["optim"].load_state_dict(state["optim"])

    def state_dict():
        return dict(model=holder["model"].module.state_dict(),
                    optim=holder["optim"].state_dict())

    transport = PGTransport(pg, timeout=timedelta(seconds=config["manager_timeout_s"]),
                            device=torch.device("cpu"))
    return torchft.Manager(
        pg=pg, min_replica_size=config["min_replicas"], load_state_dict=load_state_dict,
        state_dict=state_dict, replica_id=f"replica_{config['replica']}", store_addr=host,
        store_port=store.port, rank=0, world_size=1, lighthouse_addr=config["lighthouse"],
        hostname=host, timeout=timedelta(seconds=config["manager_timeout_s"]),
        quorum_timeout=timedelta(seconds=config["quorum_timeout_s"]),
        connect_timeout=timedelta(seconds=config["manager_timeout_s"]),
        checkpoint_transport=transport)


def _wait_for_peers(barrier: dict, replica: int) -> None:
    """config["barrier"]: here once this replica is ready, then until `count` replicas are."""
    os.makedirs(barrier["dir"], exist_ok=True)
    open(os.path.join(barrier["dir"], f"replica{replica}"), "w").close()
    deadline = time.monotonic() + barrier["timeout_s"]
    while len(os.listdir(barrier["dir"])) < barrier["count"]:
        if time.monotonic() > deadline:
            raise RuntimeError(f"replica {replica}: only {os.listdir(barrier['dir'])} of "
                               f"{barrier['count']} replicas ready in {barrier['timeout_s']} s")
        time.sleep(0.02)


def main(config: dict) -> None:
    import torchft

    torch.set_num_threads(1)  # the replay computes the same gradients (torchft_job.replay)
    replica, attempt = config["replica"], config["attempt"]
    failing = attempt == 0 and config.get("fail") is not None
    pg = torchft.ProcessGroupGloo(timeout=timedelta(seconds=config["pg_timeout_s"]))
    model = build_model(config.get("model", "small"))
    if config["impl"] == "pyreducer":
        from pyreducer.torchft import DistributedDataParallel
    else:
        from torchft import DistributedDataParallel
    holder: dict = {}
    manager = _manager(config, pg, holder)
    options = dict(bucket_cap_mb=config["bucket_cap_mb"])
    if config.get("plan") == "torchft" and config["impl"] == "pyreducer":
        options["bucket_plan"] = torchft_plan(model, config["bucket_cap_mb"])
    ddp = DistributedDataParallel(manager, model, **options)
    optimizer = build_optimizer(ddp.parameters())
    holder.update(model=ddp, optim=optimizer)
    if failing and config["fail"] != "leave":
        def hook(grad):
            if manager.current_step() == config["fail_step"]:
                _fail_now(config["fail"])
            return grad
        ddp.module[0].weight.register_hook(hook)
    if attempt == 0 and config.get("barrier"):
        _wait_for_peers(config["barrier"], replica)
    edges = {}
    if config.get("edges"):
        edges["before_quorum"] = _edge(ddp, replica, config.get("model", "small"))
    _train(config, manager, ddp, optimizer, failing)
    if config.get("edges"):  # (the last backward has ended: its quorum's group is let go)
        edges["holds_group"] = ddp._quorum.holds_group()
        edges["after_commit"] = _edge(ddp, replica, config.get("model", "small"))
    torch.save(dict(replica=replica, attempt=attempt, edges=edges,
                    params={n: p.detach().clone() for n, p in ddp.module.named_parameters()},
                    failed_steps=list(getattr(ddp, "failed_steps", [])),
                    timeline=ddp.timeline(2) if hasattr(ddp, "timeline") else None),
               config["out"])
    manager.shutdown(wait=False)


def _edge(ddp, replica: int, model: str) -> dict:
    """A forward with grad on outside torchft's protocol, then its backward: what each raised
    (None: nothing), and whether any gradient was written."""
    outcome = {}
    x, y = batch(replica, 10_000, model)
    try:
        loss = F.mse_loss(ddp(x), y)
        outcome["forward"] = None
    except Exception as error:  # noqa: BLE001 - reported to the test
        outcome["forward"] = f"{type(error).__name__}: {error}"
        return outcome
    try:
        loss.backward()
        outcome["backward"] = None
    except Exception as error:  # noqa: BLE001 - reported to the test
        outcome["backward"] = f"{type(error).__name__}: {error}"
    for p in ddp.parameters():
        p.grad = None
    return outcome


def _train(config: dict, manager, ddp, optimizer, failing: bool) -> None:
    """torchft's protocol until the Manager's step reaches config["steps"], a log line a step."""
    replica, attempt = config["replica"], config["attempt"]
    log = open(config["log"], "a")  # one line per attempted step, kept if this life dies
    # await_rejoin: a step failed (or this is a restarted life), and no committed step has had
    # every replica in it since
    awaiting = bool(config.get("await_rejoin")) and attempt > 0
    while manager.current_step() < config["steps"] or awaiting:
        if failing and config["fail"] == "leave" and manager.current_step() == config["fail_step"]:
            os._exit(3)
        entry = train_step(manager, ddp, optimizer, replica, config.get("model", "small"),
                           config.get("accumulate", 1))
        log.write(json.dumps(dict(replica=replica, attempt=attempt, **entry)) + "\n")
        log.flush()
        if config.get("await_rejoin") and not failing:
            awaiting = (awaiting or not entry["committed"]) and not _all_back(config, entry)
            if awaiting:  # trains on slowly, and past `steps` if need be, until all are back
                time.sleep(config["await_rejoin"])
        if config.get("pace_s"):
            time.sleep(config["pace_s"])


def _full(entry: dict, replicas: int) -> bool:
    return entry["committed"] and entry["participating"] and entry["participants"] == replicas


def _all_back(config: dict, entry: dict, timeout_s: float = 30.0) -> bool:
    """await_rejoin's end, agreed by every replica: this step was committed by all replicas, each
    participating, as each of them logged it. One replica's own view is not enough: should_commit
    is each replica group's own, so one replica can commit a step that another does not; the
    first would then stop awaiting and finish, the second await forever, alone. So each replica
    reads the others' logs for the same attempt (quorum id, step, and how many attempts this
    quorum made at that step), waiting for them up to `timeout_s` (a replica that died never
    logs it: not all back). Each replica decides from the same entries, so all decide alike."""
    replicas = config["replicas"]
    if not _full(entry, replicas):
        return False
    logs = os.path.dirname(config["log"])
    key = (entry["quorum"], entry["step"])
    ordinal = sum(1 for e in read_log(config["log"]) if (e.get("quorum"), e["step"]) == key)
    deadline = time.monotonic() + timeout_s
    for peer in range(replicas):
        if peer == config["replica"]:
            continue
        path = os.path.join(logs, f"replica{peer}.jsonl")
        while True:
            same = [e for e in read_log(path) if (e.get("quorum"), e["step"]) == key]
            if len(same) >= ordinal:
                if not _full(same[ordinal - 1], replicas):
                    return False
                break
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
    return True


def read_log(path: str) -> list[dict]:
    """A step log's entries, whole lines only (a line being written, or cut by a kill, is left
    out); [] where there is no log."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        lines = f.read().split("\n")
    return [json.loads(line) for line in lines[:-1] if line]


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
