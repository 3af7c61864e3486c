"""The tuning cache's parts without processes (pyreducer/tuning/memory.py): where it lives, what
keys an entry, which links match, what is ignored, and how entries are written."""
import json
from types import SimpleNamespace

import pytest
import torch

from pyreducer.tuning import LinkModel, memory


def _params(shapes=((4, 3), (4,)), world_size=2):
    tensors = [torch.zeros(s) for s in shapes]
    return SimpleNamespace(names=tuple(f"p{i}" for i in range(len(shapes))), tensors=tensors,
                           group_keys=tuple("Float/cpu" for _ in shapes), world_size=world_size)


def test_cache_path_follows_the_setting_and_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("PYREDUCER_TUNING_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert memory.cache_path(True) == str(tmp_path / "pyreducer" / "tuning.json")
    assert memory.cache_path(False) is None
    assert memory.cache_path("/x/y.json") == "/x/y.json"
    monkeypatch.setenv("PYREDUCER_TUNING_CACHE", "/elsewhere.json")
    assert memory.cache_path(True) == "/elsewhere.json"
    assert memory.cache_path("/x/y.json") == "/x/y.json"  # the argument wins
    monkeypatch.setenv("PYREDUCER_TUNING_CACHE", "off")
    assert memory.cache_path(True) is None


def test_the_key_changes_with_shapes_order_ranks_backend_and_hooks():
    key = memory.model_key(_params(), "gloo")
    assert key == memory.model_key(_params(), "gloo")
    assert key != memory.model_key(_params(((3, 4), (4,))), "gloo")
    assert key != memory.model_key(_params(((4,), (4, 3))), "gloo")
    assert key != memory.model_key(_params(world_size=4), "gloo")
    assert key != memory.model_key(_params(), "nccl")
    assert key != memory.model_key(_params(), "gloo", "/hook")


def test_links_match_within_the_tolerances():
    seen = dict(latency_s=1e-3, bandwidth_bytes_per_s=1.2e8)
    b, lat = memory.BANDWIDTH_FACTOR, memory.LATENCY_FACTOR
    assert memory.link_matches(seen, LinkModel(1e-3, 1.2e8))
    assert memory.link_matches(seen, LinkModel(1e-3 * lat * 0.9, 1.2e8 * b * 0.9))
    assert memory.link_matches(seen, LinkModel(1e-3 / lat * 1.1, 1.2e8 / b * 1.1))
    assert not memory.link_matches(seen, LinkModel(1e-3, 1.2e8 * b * 1.1))
    assert not memory.link_matches(seen, LinkModel(1e-3, 1.2e9))  # 1 against 10 Gbit/s
    assert not memory.link_matches(seen, LinkModel(1e-3 * lat * 1.1, 1.2e8))
    assert not memory.link_matches({}, LinkModel(1e-3, 1.2e8))


def test_remember_then_recall_and_what_is_ignored(tmp_path):
    path = str(tmp_path / "sub" / "tuning.json")
    link = LinkModel(1e-3, 1.2e8)
    seen = dict(latency_s=1e-3, bandwidth_bytes_per_s=1.2e8)
    assert memory.recall(path, "k", link, 2)[0] is None  # no file yet
    memory.remember(path, "k", plan=[[1], [0]], step_ms=10.0, link=seen)
    assert memory.recall(path, "k", link, 2)[0]["plan"] == [[1], [0]]
    assert "no entry" in memory.recall(path, "other", link, 2)[1]
    assert "link differs" in memory.recall(path, "k", LinkModel(1e-3, 1e9), 2)[1]
    assert "not one of this model" in memory.recall(path, "k", link, 3)[1]
    # a schedule joins its plan's entry only
    memory.remember(path, "k", for_plan=[[0, 1]], schedule={"order": [0]}, schedule_ms=9.0)
    assert "schedule" not in memory.recall(path, "k", link, 2)[0]
    memory.remember(path, "k", for_plan=[[1], [0]], schedule={"order": [1, 0]}, schedule_ms=9.0)
    assert memory.recall(path, "k", link, 2)[0]["schedule"] == {"order": [1, 0]}
    # a new plan replaces the entry, schedule and all
    memory.remember(path, "k", plan=[[0, 1]], step_ms=8.0, link=seen)
    entry, _ = memory.recall(path, "k", link, 2)
    assert entry["plan"] == [[0, 1]] and "schedule" not in entry
    with open(path) as f:
        assert json.load(f)["format"] == memory.FORMAT


@pytest.mark.parametrize("content", ["{not json", json.dumps(dict(format="x", version=1))])
def test_an_unreadable_cache_warns_and_is_ignored(tmp_path, content):
    path = tmp_path / "tuning.json"
    path.write_text(content)
    with pytest.warns(RuntimeWarning, match="tuning from scratch"):
        assert memory.recall(str(path), "k", LinkModel(1e-3, 1.2e8), 2)[0] is None


def test_a_remembered_schedule_must_fit_the_plan():
    """A chunked schedule's order holds bucket b chunks[b] times (the warm benchmark's first
    run refused every chunked schedule for checking a permutation instead)."""
    from pyreducer.overlap.schedule_recall import _fits

    assert _fits(dict(order=[1, 0], chunks=[1, 1]), 2)
    assert _fits(dict(order=[1, 1, 0, 1], chunks=[1, 3]), 2)
    assert not _fits(dict(order=[1, 0, 1], chunks=[1, 3]), 2)
    assert not _fits(dict(order=[0, 1], chunks=[1, 1]), 3)
    assert not _fits(dict(order=[0, 1]), 2)


def test_a_decision_is_printed_unless_logging_shows_it(capsys, caplog):
    import logging

    from pyreducer.tuning import announce

    rank0, rank1 = SimpleNamespace(rank=0), SimpleNamespace(rank=1)
    announce.say(rank1, "not me")
    with caplog.at_level(logging.INFO, logger="pyreducer.tuning"):
        announce.say(rank0, "logged")
    assert "logged" in caplog.text and "logged" not in capsys.readouterr().err
    with caplog.at_level(logging.WARNING, logger="pyreducer.tuning"):
        announce.say(rank0, "printed")  # logging would hide INFO: stderr instead
    err = capsys.readouterr().err
    assert "printed" in err and "not me" not in err
