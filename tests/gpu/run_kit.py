"""The GPU kit in one command, for a machine with a GPU and no network (docs/pages/guides/gpus.md,
"The GPU kit").

    python3 tests/gpu/run_kit.py --out DIR           # from the checkout, on the GPU machine
    make gpu-test GPU_PYTHON=python3 GPU_OUT=DIR     # the same

It uses the interpreter that runs it and the torch installed there; it downloads and installs
nothing. In order, each step printed as it ends:
  1. facts: interpreter, torch, CUDA, NCCL, GPUs, nvcc, cores;
  2. pip would keep that torch: offline, `pip install --dry-run --no-index` finds
     pyreducer's requirements satisfied by what is installed (and notes whether
     `pip install --no-build-isolation .` itself works);
  3. the build: pyreducer with its CUDA kernels for the visible GPUs' architectures (--arch
     chooses), with every core, into build/gpu-kit (not in place), and its import;
  4. the tests (tests/gpu and the CUDA op tests; --full: the whole suite) until the tests'
     deadline (the budget less the benchmark's share): a test not reached by then is reported
     as not run, with that reason;
  5. the GPU benchmark (benchmarks/bench_gpu.py) in the time left.
DIR then holds summary.md (what ran, failed and could not run, and why), kit.json (the same as
data), junit.xml, kit.log (this output), build.log, pytest.log, bench.json and bench.png.

--rehearse, on a machine without a GPU: steps 1-3 for --arch (default 9.0, the lent GPU
machine's H100/H200), then the selection collected with the plan of what a one-GPU machine
would run; nothing calls CUDA (make gpu-rehearsal, run by CI).
--build-only: step 3 alone, into --build-dir (make cuda-build).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)

import kit_report  # noqa: E402

SELECTION = ["tests/gpu/test_gpu_kernels.py", "tests/unit/test_ops.py",
             "tests/gpu/test_gpu_one_rank.py", "tests/gpu/test_gpu_ranks.py"]
FULL = ["tests"]
REHEARSAL_ARCH = "9.0"


class Kit:
    """One run: the steps' results, printed and written to `out` as they end."""

    def __init__(self, args):
        self.args, self.start = args, time.monotonic()
        self.out = os.path.abspath(args.out) if args.out else None
        self.log = None
        if self.out:  # append mode: the benchmark's output is appended to the same file
            os.makedirs(self.out, exist_ok=True)
            for name in ("kit.log", "build.log", "pytest.log"):
                open(os.path.join(self.out, name), "w").close()
            self.log = open(os.path.join(self.out, "kit.log"), "a")
        self.report = {"label": args.label, "rehearse": args.rehearse, "steps": []}

    def say(self, text: str) -> None:
        line = f"[kit {self.elapsed_s():5.0f} s] {text}"
        print(line, flush=True)
        if self.log:
            self.log.write(line + "\n")
            self.log.flush()

    def elapsed_s(self) -> float:
        return time.monotonic() - self.start

    def step(self, name: str, result: str, started: float) -> None:
        self.report["steps"].append(dict(name=name, result=result,
                                         seconds=time.monotonic() - started))
        self.say(f"{name}: {result}")
        self.write()

    def write(self) -> None:
        if not self.out:
            return
        with open(os.path.join(self.out, "kit.json"), "w") as f:
            json.dump(self.report, f, indent=1, default=str)
        with open(os.path.join(self.out, "summary.md"), "w") as f:
            f.write(kit_report.summary_markdown(self.report))

    def run(self, command: list[str], log_name: str | None, env: dict | None = None,
            timeout_s: float | None = None) -> int:
        """Runs `command` in the checkout, its output shown and kept in `log_name` under the
        output folder; the exit status, or -9 if it ran past `timeout_s` and was killed (with
        every process it started), silent or not."""
        self.say("$ " + " ".join(command))
        log = open(os.path.join(self.out, log_name), "a") if self.out and log_name else None
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, encoding="utf-8",
                                   errors="replace", start_new_session=True)
        killed = threading.Event()

        def kill():
            if process.poll() is None:
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                    killed.set()
                except ProcessLookupError:  # it ended meanwhile
                    pass

        timer = threading.Timer(timeout_s, kill) if timeout_s is not None else None
        if timer:
            timer.start()
        try:
            for line in process.stdout:  # ends when the process (group) is gone
                sys.stdout.write(line)
                if log:
                    log.write(line)
                    log.flush()
            status = process.wait()
        finally:
            if timer:
                timer.cancel()
            if log:
                log.close()
        if killed.is_set():
            self.say(f"killed after {timeout_s:.0f} s")
            return -9
        return status


def facts() -> dict:
    import torch

    def nvcc_version():
        nvcc = shutil.which("nvcc") or os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"),
                                                    "bin", "nvcc")
        try:
            text = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
            return text.strip().splitlines()[-1]
        except OSError:
            return "not found"

    gpus = [f"{torch.cuda.get_device_name(i)} (sm_{''.join(map(str, torch.cuda.get_device_capability(i)))})"
            for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as error:  # noqa: BLE001 - a CPU torch has no NCCL
        nccl = f"none ({type(error).__name__})"
    return dict(date=datetime.datetime.now().isoformat(timespec="seconds"),
                python=f"{platform.python_version()} ({sys.executable})", torch=torch.__version__,
                cuda=torch.version.cuda, nccl=nccl, gpus=", ".join(gpus) or "none visible",
                nvcc=nvcc_version(), ninja=shutil.which("ninja") or "not on PATH",
                cores=os.cpu_count(), machine=platform.machine())


def pip_keeps_torch(kit: Kit) -> str:
    """Whether pip, offline, finds pyreducer's requirements (pyproject.toml) satisfied by what is
    installed, so that it would not replace torch; then whether `pip install --dry-run
    --no-build-isolation .` itself works (a note if not: old setuptools without wheel fail)."""
    import tomllib

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        requirements = tomllib.load(f)["project"]["dependencies"]
    report_path = os.path.join(REPO, "build", "gpu-kit-pip-report.json")
    os.makedirs(os.path.dirname(report_path), exist_ok=True)
    dry_run = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--quiet",
               "--report", report_path]
    status = kit.run(dry_run + requirements, "build.log", timeout_s=120)
    if status != 0:
        return f"FAILED: pip cannot satisfy {requirements} offline: {last_error(kit, 'build.log')}"
    with open(report_path) as f:
        names = sorted(entry["metadata"]["name"] for entry in json.load(f).get("install", []))
    if names:
        return f"FAILED: for {requirements} pip would install {names}"
    status = kit.run(dry_run + ["--no-build-isolation", "."], "build.log", timeout_s=180)
    note = "" if status == 0 else \
        f"; but `pip install --no-build-isolation .` fails here: {last_error(kit, 'build.log')}"
    return f"ok: {requirements} are satisfied by what is installed{note}"


def last_error(kit: Kit, log_name: str) -> str:
    """The last specific 'error: ...' line of a log (pip's generic ones skipped), for the
    summary; the log has the rest."""
    generic = ("subprocess-exited-with-error", "metadata-generation-failed")
    found = "see " + log_name
    if kit.out:
        with open(os.path.join(kit.out, log_name)) as f:
            for line in f:
                text = line.strip()
                if text.lower().startswith("error:") and not any(g in text for g in generic):
                    found = f"{text} ({log_name})"
    return found


def build(kit: Kit, arch: str | None, build_dir: str, jobs: int, timeout_s: float) -> bool:
    """pyreducer built with its CUDA kernels into build_dir/pkg (the package and its _C), then
    imported there; True if both worked within `timeout_s`."""
    env = dict(os.environ, MAX_JOBS=str(jobs), PYREDUCER_CUDA="1",
               PATH=os.pathsep.join([sysconfig.get_path("scripts"), os.environ.get("PATH", "")]))
    if arch:
        env["TORCH_CUDA_ARCH_LIST"] = arch
    if not shutil.which("ninja", path=env["PATH"]):  # torch would compile one file at a time
        kit.say("no ninja on PATH or beside this interpreter: the build will be slow")
    status = kit.run([sys.executable, "setup.py", "build_ext", "--build-lib",
                      os.path.join(build_dir, "lib"), "--build-temp",
                      os.path.join(build_dir, "temp")], "build.log", env=env, timeout_s=timeout_s)
    if status != 0:
        return False
    package = os.path.join(build_dir, "pkg", "pyreducer")
    shutil.rmtree(os.path.dirname(package), ignore_errors=True)
    shutil.copytree(os.path.join(REPO, "pyreducer"), package,
                    ignore=shutil.ignore_patterns("_C*.so", "__pycache__"))
    for name in os.listdir(os.path.join(build_dir, "lib", "pyreducer")):
        if name.startswith("_C") and name.endswith(".so"):
            shutil.copy2(os.path.join(build_dir, "lib", "pyreducer", name), package)
    check = ("import torch, pyreducer; assert pyreducer._C.WITH_CUDA, 'built without CUDA "
             "kernels'; print('imported pyreducer from', pyreducer.__file__, 'with CUDA kernels "
             "against torch', torch.__version__, '; GPUs visible:', torch.cuda.device_count())")
    return kit.run([sys.executable, "-P", "-c", check], "build.log", timeout_s=120,
                   env=dict(os.environ, PYTHONPATH=os.path.dirname(package))) == 0


def pytest_command(selection: list[str], junit: str | None, extra: list[str]) -> list[str]:
    # -P: the checkout's own pyreducer (no _C built in place) must not shadow build/gpu-kit's.
    # -v: pytest.log names each test as it ends (junit.xml is written only at the session's
    # end); --durations: the next run's budget can be planned from this one's.
    command = [sys.executable, "-P", "-m", "pytest", "-p", "no:cacheprovider", "-p", "kit_plugin",
               "-v", "-rfEs", "--durations=30"] + extra
    return command + (["--junitxml", junit] if junit else []) + selection


def test_env(package_dir: str, **extra) -> dict:
    path = os.pathsep.join([package_dir, HERE] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    return dict(os.environ, PYTHONPATH=path, **{k: str(v) for k, v in extra.items()})


def run_tests(kit: Kit, package_dir: str, deadline_s: float) -> None:
    """The selection until `deadline_s` (kit time), then the outcome from junit.xml."""
    started = time.monotonic()
    junit = os.path.join(kit.out, "junit.xml")
    wall_deadline = time.time() + (deadline_s - kit.elapsed_s())
    selection = FULL if kit.args.full else SELECTION
    status = kit.run(pytest_command(selection, junit, []), "pytest.log",
                     env=test_env(package_dir, PYREDUCER_KIT_DEADLINE=wall_deadline),
                     timeout_s=max(60.0, deadline_s - kit.elapsed_s() + 120))
    if not os.path.exists(junit):
        kit.step("tests", f"FAILED: pytest exited with {status} and wrote no junit.xml "
                          "(pytest.log)", started)
        return
    kit.report["tests"] = kit_report.read_junit(junit)
    n = kit_report.counts(kit.report["tests"])
    verdict = "ok" if n["failed"] == 0 and status == 0 else f"FAILED (pytest exited with {status})"
    kit.step("tests", f"{verdict}: {n['passed']} passed, {n['failed']} failed, "
                      f"{n['skipped']} not run", started)


def plan_tests(kit: Kit, package_dir: str) -> None:
    """The rehearsal: the selection collected as if one GPU were visible, nothing run."""
    started = time.monotonic()
    plan_path = os.path.join(REPO, "build", "gpu-kit-plan.json")
    status = kit.run(pytest_command(SELECTION, None, ["--collect-only"]), "pytest.log",
                     env=test_env(package_dir, PYREDUCER_KIT_PLAN=plan_path,
                                  PYREDUCER_KIT_ASSUME_GPUS=1), timeout_s=600)
    if status != 0 or not os.path.exists(plan_path):
        kit.step("collection", f"FAILED: pytest --collect-only exited with {status}", started)
        return
    with open(plan_path) as f:
        kit.report["plan"] = plan = json.load(f)
    skipped = sum(len(ids) for ids in plan["skip"].values())
    verdict = "ok" if plan["run"] else "FAILED: nothing would run"
    kit.step("collection", f"{verdict}: on one GPU {len(plan['run'])} tests would run, "
                           f"{skipped} would not (plus the CUDA variants of test_ops.py)", started)


def bench(kit: Kit, package_dir: str, budget_s: float) -> None:
    started = time.monotonic()
    if budget_s < 60:
        kit.step("benchmark", f"not run: time budget ({budget_s:.0f} s left)", started)
        return
    files = {name: os.path.join(kit.out, name) for name in ("bench.json", "bench.png")}
    markdown = os.path.join(REPO, "build", "gpu-kit-bench.md")
    status = kit.run([sys.executable, "-P", "benchmarks/bench_gpu.py", "--budget-s",
                      f"{budget_s - 20:.0f}", "--json", files["bench.json"], "--plot",
                      files["bench.png"], "--markdown", markdown], "kit.log",
                     env=test_env(package_dir), timeout_s=budget_s)
    if os.path.exists(markdown):
        with open(markdown) as f:
            kit.report["bench_markdown"] = f.read()
    kit.step("benchmark", "ok" if status == 0 else f"FAILED: exited with {status}", started)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="folder for the report files (required unless --build-only)")
    parser.add_argument("--full", action="store_true", help="the whole test suite, not the GPU "
                        "selection")
    parser.add_argument("--budget-s", type=float, default=540.0,
                        help="seconds for everything (default 540)")
    parser.add_argument("--bench-s", type=float, default=120.0, help="seconds kept for the "
                        "benchmark at the end (default 120; 0: no benchmark)")
    parser.add_argument("--arch", help="TORCH_CUDA_ARCH_LIST for the build (default: the visible "
                        f"GPUs'; {REHEARSAL_ARCH} with --rehearse)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count(), help="compile jobs "
                        "(default: every core)")
    parser.add_argument("--build-dir", default=os.path.join(REPO, "build", "gpu-kit"))
    parser.add_argument("--label", default="", help="what is run (e.g. the commit), for the "
                        "report")
    parser.add_argument("--rehearse", action="store_true", help="without a GPU: up to the first "
                        "CUDA call")
    parser.add_argument("--build-only", action="store_true")
    args = parser.parse_args(argv)
    if sys.version_info < (3, 11):
        parser.error("the kit needs Python 3.11+ (python -P keeps the checkout off sys.path)")
    if not args.out and not args.build_only:
        parser.error("--out DIR is required")
    kit = Kit(args)
    arch = args.arch or (REHEARSAL_ARCH if args.rehearse else None)
    if not args.build_only:
        started = time.monotonic()
        kit.report["facts"] = facts()
        kit.say("; ".join(f"{k} {v}" for k, v in kit.report["facts"].items()))
        kit.step("facts", "ok (the table above)", started)
        started = time.monotonic()
        kit.step("pip check", pip_keeps_torch(kit), started)
    started = time.monotonic()
    built = build(kit, arch, args.build_dir, args.jobs,
                  1800.0 if args.build_only else max(60.0, args.budget_s - kit.elapsed_s() - 60))
    kit.step("build", f"{'ok' if built else 'FAILED'}: architectures {arch or 'of the visible GPUs'}"
                      f", {args.jobs} jobs (build.log)", started)
    package_dir = os.path.join(args.build_dir, "pkg")
    if not built or args.build_only:
        return 0 if built else 1
    if args.rehearse:
        plan_tests(kit, package_dir)
    else:
        run_tests(kit, package_dir, args.budget_s - args.bench_s)
        if args.bench_s > 0:
            bench(kit, package_dir, args.budget_s - kit.elapsed_s())
    kit.write()
    failed = [s["name"] for s in kit.report["steps"] if s["result"].startswith("FAILED")]
    kit.say(f"done: {'everything ok' if not failed else 'FAILED: ' + ', '.join(failed)}; the report "
            f"is in {kit.out}/summary.md")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
