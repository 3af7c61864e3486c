"""What pyreducer.DistributedDataParallel (pyreducer/distributed.py) is made of, one concept a
module. distributed.py builds these; nothing here reads the wrapper's private state.
  - arguments.py       torch DDP's constructor arguments, checked and resolved as DDP does;
  - params.py          ReducedParams: the reduced parameters as one object (names, order, groups);
  - bucketing.py       DDP's cap arguments, saved and replayed bucket plans;
  - sync.py            agreement between ranks: model check, rank 0's broadcast, buffer sync;
  - nested.py          the one walker of nested forward inputs and outputs;
  - join.py            uneven inputs (torch's Join protocol);
  - delayed.py         delay_all_reduce_named_params, as torch DDP;
  - precision.py       mixed_precision, with torch DDP's numerics;
  - watch.py           parameters changed after wrapping, refused by name;
  - failures.py        which ranks were lost when a collective fails;
  - timeline.py        the per-iteration timeline as Python data, overlap statistics;
  - ddp_logging.py     torch DDP's logging data (_get_ddp_logging_data);
  - gloo_race.py       sparse buckets kept away from a Gloo race;
  - teardown.py        a moment for Gloo's threads at interpreter exit;
  - torch_versions.py  what differs between the supported torch versions, in one place.
"""
