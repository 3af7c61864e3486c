"""The GPU kit: what only a GPU can check (CUDA kernels, NCCL, CUDA streams and events).

Everything here is skipped, with the reason, where CUDA or a CUDA build of pyreducer is absent;
CI collects it (a collection error fails CI; `make gpu-rehearsal` plans it for one GPU) but
cannot run it. tests/gpu/run_kit.py (`make gpu-test`) builds the CUDA extension and runs the kit
(and the CUDA variants of tests/unit/test_ops.py), then says what ran and what could not (NCCL
settings with more ranks than visible GPUs are skipped; Gloo ranks share the GPU: gpu_kit.py).
"""
from gpu_kit import GPUS, WITH_CUDA


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    passed = [r.nodeid for r in terminalreporter.stats.get("passed", []) if "tests/gpu" in r.nodeid]
    failed = [r.nodeid for r in terminalreporter.stats.get("failed", []) if "tests/gpu" in r.nodeid]
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if "tests/gpu" in r.nodeid]
    if not (passed or failed or skipped):
        return
    reasons: dict[str, int] = {}
    for report in skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        reasons[reason] = reasons.get(reason, 0) + 1
    terminalreporter.section("GPU kit")
    terminalreporter.line(f"{GPUS} GPU(s) visible, pyreducer built with CUDA kernels: {WITH_CUDA}")
    terminalreporter.line(f"ran: {len(passed)} passed, {len(failed)} failed")
    for reason, count in sorted(reasons.items()):
        terminalreporter.line(f"not run: {count} test(s): {reason}")
