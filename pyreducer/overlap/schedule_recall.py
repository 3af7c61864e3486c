"""The overlapped optimizer's schedule tuner (schedule_tuner.py), remembered: installing the
schedule the tuning cache (memory.py) holds for the bucket plan bucket autotune recalled, timing
it for one window, and saying and remembering each decision (announce.py)."""
from __future__ import annotations

import statistics

from pyreducer.tuning import announce, memory

ROUNDS_DONE = 1 << 30  # a round counter past any ROUNDS: the recalled window is the only one


class ScheduleRecall:
    """Part of ScheduleTuner (its state: autotune, candidates, trials, round, samples, ...)."""

    def _recall(self, plan) -> bool:
        """Installs the schedule the tuning cache remembered for this plan (bucket autotune
        recalled it: memory.py) and times it for one window; returns whether it did."""
        recalled = self.autotune.recalled if self.autotune is not None else None
        if recalled is None or self.chunk_bytes is not None or plan == self.recall_rejected_for \
                or not recalled.get("schedule") \
                or self.tuning.current_plan() != recalled["plan"] \
                or not _fits(recalled["schedule"], len(recalled["plan"])):
            return False
        self.planned_for = plan
        self.candidates = [dict(recalled["schedule"], remembered_ms=recalled["schedule_ms"])]
        self.log.append(dict(event="recalled", describe=self.candidates[0]["describe"],
                             remembered_ms=recalled["schedule_ms"]))
        self.recalling, self.trials, self.round = True, [0], ROUNDS_DONE  # one window
        self.samples = [[]]
        self._next_trial()
        return True

    def _decide_recall(self, windows) -> None:
        """After the remembered schedule's window: kept if within memory.RECALL_TOLERANCE of
        its remembered step time; else planned as without a cache at the next synced forward."""
        self.recalling = False
        chosen = self.candidates[0]
        measured_ms = statistics.median(windows[0]) * 1e3
        if measured_ms <= (1 + memory.RECALL_TOLERANCE) * chosen["remembered_ms"]:
            self._install(chosen, "chosen", measured_ms=measured_ms, recalled=True)
            self._announce(dict(chosen, measured_ms=measured_ms), [], recalled=True)
            return
        self.log.append(dict(event="recall rejected", describe=chosen["describe"],
                             measured_ms=measured_ms, remembered_ms=chosen["remembered_ms"]))
        self.recall_rejected_for, self.planned_for, self.candidates = self.planned_for, None, []

    def _announce(self, chosen: dict, candidates: list[dict], recalled: bool = False) -> None:
        """Says the decision on rank 0 and remembers it with bucket autotune's plan (memory.py;
        not a fixed chunk size's, nor without bucket autotune: its entry keys the plan)."""
        params, autotune = self.tuning.params, self.autotune
        if autotune is None or autotune.config.announce:
            announce.say(params, announce.chosen_schedule(
                chosen, candidates, self.reducer.num_iterations, recalled,
                autotune.cache_path if autotune is not None else None))
        if params.rank == 0 and not recalled and self.chunk_bytes is None and \
                autotune is not None and autotune.memory_key is not None:
            keep = ("order", "chunks", "chunk_bytes", "budget_bytes", "barrier", "describe",
                    "predicted_ms")
            memory.remember(autotune.cache_path, autotune.memory_key,
                            for_plan=self.tuning.current_plan(),
                            schedule={k: chosen[k] for k in keep if k in chosen},
                            schedule_ms=chosen["measured_ms"])


def _fits(schedule: dict, buckets: int) -> bool:
    """Whether a remembered schedule is one of `buckets` buckets: its launch order holds bucket b
    chunks[b] times (Note [Launch order] in csrc/reducer.h)."""
    order, chunks = schedule.get("order", []), schedule.get("chunks", [])
    return len(chunks) == buckets and sorted(order) == sorted(
        b for b in range(buckets) for _ in range(chunks[b]))
