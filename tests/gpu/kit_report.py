"""The GPU kit's report: the tests' outcome read from pytest's JUnit XML, and summary.md, which
says what ran, what failed and what could not run, and why (tests/gpu/run_kit.py writes both)."""
from __future__ import annotations

import xml.etree.ElementTree as ElementTree


def read_junit(path: str) -> dict:
    """{"passed": [ids], "failed": [{"id", "message"}], "skipped": {reason: [ids]}, "seconds"}
    from pytest's JUnit XML (errors count as failed)."""
    root = ElementTree.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    outcome = {"passed": [], "failed": [], "skipped": {}, "seconds": 0.0}
    for suite in suites:
        outcome["seconds"] += float(suite.get("time", 0.0))
        for case in suite.iter("testcase"):
            test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
            failure = case.find("failure")
            if failure is None:
                failure = case.find("error")
            skipped = case.find("skipped")
            if failure is not None:
                message = (failure.get("message") or failure.text or "").strip()
                outcome["failed"].append({"id": test_id, "message": message.splitlines()[0]
                                          if message else ""})
            elif skipped is not None:
                reason = (skipped.get("message") or "skipped").removeprefix("Skipped: ")
                outcome["skipped"].setdefault(reason, []).append(test_id)
            else:
                outcome["passed"].append(test_id)
    return outcome


def counts(outcome: dict) -> dict:
    return {"passed": len(outcome["passed"]), "failed": len(outcome["failed"]),
            "skipped": sum(len(ids) for ids in outcome["skipped"].values())}


def summary_markdown(report: dict) -> str:
    """summary.md from run_kit.py's report (kit.json's content)."""
    facts = report["facts"]
    lines = [f"# GPU kit report{' (rehearsal: no CUDA call)' if report['rehearse'] else ''}",
             "", f"{report.get('label') or 'unlabelled run'}, {facts['date']}", "",
             "| fact | value |", "|---|---|"]
    lines += [f"| {key} | {value} |" for key, value in facts.items() if key != "date"]
    lines += ["", "## Steps", "", "| step | result | seconds |", "|---|---|---|"]
    for step in report["steps"]:
        lines.append(f"| {step['name']} | {step['result']} | {step['seconds']:.0f} |")
    tests = report.get("tests")
    if tests:
        lines += ["", "## Tests", ""]
        n = counts(tests)
        lines.append(f"{n['passed']} passed, {n['failed']} failed, {n['skipped']} not run "
                     f"({tests['seconds']:.0f} s).")
        if tests["failed"]:
            lines += ["", "Failed:"] + [f"- `{f['id']}`: {f['message']}" for f in tests["failed"]]
        if tests["skipped"]:
            lines += ["", "Not run, and why:"]
            lines += [f"- {len(ids)}: {reason}"
                      for reason, ids in sorted(tests["skipped"].items(), key=lambda r: -len(r[1]))]
    plan = report.get("plan")
    if plan:
        lines += ["", "## Plan for a one-GPU machine (collected, not run)", "",
                  f"{len(plan['run'])} tests would run."]
        lines += [f"- {len(ids)} would not: {reason}" for reason, ids in plan["skip"].items()]
    if report.get("bench_markdown"):
        lines += ["", "## Benchmark", "", report["bench_markdown"].strip()]
    return "\n".join(lines) + "\n"
