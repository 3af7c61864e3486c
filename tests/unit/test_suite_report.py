"""benchmarks/suite_report.py: each variant's bucket autotune choice in the suite's table (the
barrier's, and the overlap's, recalled from the barrier's under bench.py --caps-once)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import suite_report  # noqa: E402


def _entry():
    return {"torch": {"median_ms": 800.0}, "auto": {"median_ms": 700.0},
            "overlap": {"median_ms": 690.0},
            "auto_log": [{"event": "not recalled", "reason": "no entry"},
                         {"event": "chosen", "plan": "cap 1 MB", "buckets": 11}],
            "overlap_log": [{"event": "recalled", "buckets": 11},
                            {"event": "chosen", "plan": "remembered", "buckets": 11}]}


def test_caps_name_the_plan_and_a_recall():
    entry = _entry()
    assert suite_report.caps(entry, "auto") == "cap 1 MB, 11 buckets"
    assert suite_report.caps(entry, "overlap") == "recalled (the barrier's), 11 buckets"
    assert suite_report.caps(entry, "sharded") == "-"


def test_the_table_has_both_choices():
    data = {"runs": [dict(model="m", batch=4, link="1gbit", hosts=2, parity_max_diff={"x": 0.0},
                          comm_only_ms=100.0, results={"default": _entry()})]}
    table = suite_report.markdown(data)
    header, _, row = table.splitlines()[:3]
    cells = dict(zip([c.strip() for c in header.split("|")], [c.strip() for c in row.split("|")]))
    assert cells["barrier's caps"] == "cap 1 MB, 11 buckets"
    assert cells["overlap's caps"] == "recalled (the barrier's), 11 buckets"
