"""The torchft job's await_rejoin end (pyreducer/testing/torchft_replica._all_back): every replica
decides from the same logged entries, so no replica awaits a peer that has already finished.
should_commit is each replica group's own: a replica can commit a step its peer did not."""
import json

from pyreducer.testing import torchft_replica as replica


def _entry(step, quorum=7, committed=True, participating=True, participants=2):
    return dict(step=step, quorum=quorum, committed=committed, participating=participating,
                participants=participants)


def _write(path, entries, partial=""):
    path.write_text("".join(json.dumps(e) + "\n" for e in entries) + partial)


def _config(tmp_path, me=0):
    return dict(replicas=2, replica=me, log=str(tmp_path / f"replica{me}.jsonl"))


def test_all_back_when_both_logged_the_same_attempt_full(tmp_path):
    _write(tmp_path / "replica0.jsonl", [_entry(5)])
    _write(tmp_path / "replica1.jsonl", [_entry(5)])
    assert replica._all_back(_config(tmp_path, 0), _entry(5), timeout_s=0.1)
    assert replica._all_back(_config(tmp_path, 1), _entry(5), timeout_s=0.1)


def test_a_step_the_peer_did_not_commit_is_not_all_back_for_either(tmp_path):
    _write(tmp_path / "replica0.jsonl", [_entry(5)])
    _write(tmp_path / "replica1.jsonl", [_entry(5, committed=False)])
    assert not replica._all_back(_config(tmp_path, 0), _entry(5), timeout_s=0.1)
    assert not replica._all_back(_config(tmp_path, 1), _entry(5, committed=False),
                                 timeout_s=0.1)


def test_attempts_at_one_step_in_one_quorum_pair_in_order(tmp_path):
    """Both failed step 5 once in quorum 7, then both committed it: the second attempts pair."""
    _write(tmp_path / "replica0.jsonl", [_entry(5, committed=False), _entry(5)])
    _write(tmp_path / "replica1.jsonl", [_entry(5, committed=False), _entry(5)])
    assert replica._all_back(_config(tmp_path, 0), _entry(5), timeout_s=0.1)


def test_an_attempt_in_another_quorum_does_not_count(tmp_path):
    """The survivor's failed try at step 4 (quorum 3, the killed replica's first life in it) is
    not the restarted replica's attempt at step 4 (quorum 8)."""
    _write(tmp_path / "replica0.jsonl", [_entry(4, quorum=3, committed=False)])
    _write(tmp_path / "replica1.jsonl", [_entry(4, quorum=8)])
    assert not replica._all_back(_config(tmp_path, 1), _entry(4, quorum=8), timeout_s=0.1)


def test_a_peer_that_never_logs_the_step_is_not_back_and_the_wait_is_bounded(tmp_path):
    import time

    _write(tmp_path / "replica0.jsonl", [_entry(5)])
    _write(tmp_path / "replica1.jsonl", [_entry(4)], partial='{"step": 5, "quor')
    start = time.monotonic()
    assert not replica._all_back(_config(tmp_path, 0), _entry(5), timeout_s=0.3)
    assert 0.3 <= time.monotonic() - start < 5


def test_a_step_this_replica_saw_without_everyone_needs_no_peer(tmp_path):
    assert not replica._all_back(_config(tmp_path, 0), _entry(5, participants=1), timeout_s=0)
    assert not replica._all_back(_config(tmp_path, 0), _entry(5, participating=False),
                                 timeout_s=0)
