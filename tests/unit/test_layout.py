"""The tree's rules, checked: `import pyreducer` loads the library only (not its tools,
matplotlib or torch._dynamo); no module beside distributed.py reads the wrapper's private
attributes; functions and files stay small; build facts (sources, C++ standard, version,
defaults) are stated once."""
import ast
import glob
import json
import os
import re
import subprocess
import sys

import pytest

import pyreducer

PACKAGE = os.path.dirname(os.path.abspath(pyreducer.__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(ROOT)
TOOLING = ("pyreducer.tools", "pyreducer.observe", "pyreducer.testing")
MAX_FUNCTION_LINES, MAX_FILE_LINES = 60, 500
# A longer function or file says why in a comment with this tag on its first line.
EXEMPT = "layout: long because"


def _python_files():
    return sorted(glob.glob(os.path.join(PACKAGE, "**", "*.py"), recursive=True))


def _csrc_files():
    return sorted(p for ext in ("cpp", "h", "cu") for p in
                  glob.glob(os.path.join(REPO, "csrc", "**", f"*.{ext}"), recursive=True))


def test_import_loads_the_library_only(tmp_path):
    code = ("import sys, json, pyreducer; "
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith(('pyreducer', "
            "'matplotlib', 'torch._dynamo', 'lightning', 'accelerate', 'transformers', "
            "'torchft')))))")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(PACKAGE))
    env.pop("PYREDUCER_TRACE", None)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, env=env, cwd=str(tmp_path))  # not the checkout's copy
    assert result.returncode == 0, result.stderr
    loaded = json.loads(result.stdout)
    assert "pyreducer.distributed" in loaded  # the check sees what was imported
    assert not [m for m in loaded if m.startswith("matplotlib")], loaded
    assert not [m for m in loaded if m.startswith(TOOLING)], loaded
    # torch.compile's machinery costs ~2 s of CPU per process: loaded when an overlapped
    # optimizer is made (pyreducer/overlap/optimizer.py, _keep_eager), not by the import
    assert not [m for m in loaded if m.startswith("torch._dynamo")], loaded
    # the framework adapters (pyreducer.lightning, .accelerate, .transformers) and
    # pyreducer.torchft load their framework when imported themselves, never with pyreducer
    assert not [m for m in loaded if m.startswith(("lightning", "accelerate", "transformers",
                                                   "torchft"))], loaded


def test_the_frameworks_tested_are_the_test_extras_pins():
    """make test installs the Makefile's FRAMEWORKS: the versions pyproject's test extra pins."""
    makefile = open(os.path.join(REPO, "Makefile")).read()
    installed = re.search(r"^FRAMEWORKS := (.*)$", makefile, re.M).group(1).split()
    extra = re.search(r"^test = \[(.*)\]$", open(os.path.join(REPO, "pyproject.toml")).read(),
                      re.M).group(1)
    pinned = [p.strip().strip('"') for p in extra.split(",") if "==" in p]
    assert len(installed) == 4 and sorted(installed) == sorted(pinned), (installed, pinned)


def _wrapper_private_names() -> set[str]:
    """Private attributes and methods that distributed.py defines on the wrapper."""
    tree = ast.parse(open(os.path.join(PACKAGE, "distributed.py")).read())
    wrapper = next(n for n in tree.body if isinstance(n, ast.ClassDef)
                   and n.name == "DistributedDataParallel")
    names = {n.name for n in wrapper.body if isinstance(n, ast.FunctionDef)}
    for node in ast.walk(wrapper):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id == "self" and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
    return {n for n in names if n.startswith("_") and not n.startswith("__")} - TORCH_INTERFACE


# torch DDP's "private" methods that are its interface (research code and torch's own tests
# call them), not pyreducer's private state.
TORCH_INTERFACE = {"_get_ddp_logging_data", "_set_ddp_runtime_logging_sample_rate",
                   "_set_static_graph", "_set_params_and_buffers_to_ignore_for_model"}


def test_no_module_but_distributed_reads_the_wrappers_private_state():
    private = _wrapper_private_names()
    assert {"_params", "_tuning", "_autotune", "_build_reducer"} <= private  # the check works
    offenders = []
    for path in _python_files():
        if os.path.basename(path) == "distributed.py":
            continue
        text = open(path).read()
        for name in private:
            for match in re.finditer(rf"\.{re.escape(name)}\b", text):
                line = text.count("\n", 0, match.start()) + 1
                offenders.append(f"{os.path.relpath(path, PACKAGE)}:{line} .{name}")
    assert not offenders, offenders


def _exempt(lines, lineno) -> bool:
    return any(EXEMPT in lines[i] for i in range(max(0, lineno - 2), min(len(lines), lineno + 1)))


def test_python_functions_stay_short():
    long = []
    for path in _python_files():
        text = open(path).read()
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES and not _exempt(lines, node.lineno):
                    long.append(f"{os.path.relpath(path, PACKAGE)}:{node.lineno} {node.name} "
                                f"({length} lines)")
    assert not long, long


def _cpp_functions(path):
    """(first line, name, length) of every function defined at namespace level (this tree's
    style: such definitions start in column 0 and their closing brace is a lone '}')."""
    lines = open(path).read().splitlines()
    start = None
    for i, line in enumerate(lines):
        if start is None and line and not line[0].isspace() and line.rstrip().endswith("{") \
                and "(" in line + (lines[i - 1] if i else "") \
                and not re.match(r"(namespace|struct|class|enum|#|//|extern)", line):
            start = i
        elif start is not None and line == "}":
            yield start + 1, lines[start].split("(")[0][-60:], i - start + 1
            start = None


def test_cpp_functions_stay_short():
    functions = [(p, *f) for p in _csrc_files() if not p.endswith(".h") for f in _cpp_functions(p)]
    assert len(functions) > 40  # the scan finds the definitions
    long = [f"{os.path.relpath(p, REPO)}:{line} {name} ({n} lines)"
            for p, line, name, n in functions
            if n > MAX_FUNCTION_LINES and not _exempt(open(p).read().splitlines(), line - 1)]
    assert not long, long


def test_files_stay_small():
    big = []
    for path in _python_files() + _csrc_files():
        lines = open(path).read().splitlines()
        if len(lines) > MAX_FILE_LINES and not any(EXEMPT in line for line in lines[:5]):
            big.append(f"{os.path.relpath(path, REPO)} ({len(lines)} lines)")
    assert not big, big


def _cmake_lists():
    text = re.sub(r"#.*", "", open(os.path.join(REPO, "csrc", "sources.cmake")).read())
    return {name: values.split() for name, values in re.findall(r"set\((\w+)\s+([^)]*)\)", text)}


def test_one_source_list_covers_every_source():
    lists = _cmake_lists()
    listed = [p for name, paths in lists.items() if name.endswith("_SOURCES") for p in paths]
    on_disk = sorted(os.path.relpath(p, REPO) for p in _csrc_files() if not p.endswith(".h"))
    assert sorted(listed) == on_disk
    cmake = open(os.path.join(REPO, "CMakeLists.txt")).read()
    assert "include(csrc/sources.cmake)" in cmake and "csrc/reducer.cpp" not in cmake
    assert "glob" not in open(os.path.join(REPO, "setup.py")).read()


def test_build_facts_are_stated_once():
    standard = _cmake_lists()["PYREDUCER_CXX_STANDARD"][0]
    cmake = open(os.path.join(REPO, "CMakeLists.txt")).read()
    assert "${PYREDUCER_CXX_STANDARD}" in cmake and not re.search(r"STANDARD \d", cmake)
    readme = open(os.path.join(REPO, "README.md")).read()
    assert set(re.findall(r"C\+\+(\d\d)", readme)) <= {standard}, "README names another standard"
    pyproject = open(os.path.join(REPO, "pyproject.toml")).read()
    assert not re.search(r'^version\s*=\s*"', pyproject, re.M)
    assert "pyreducer._version" in pyproject
    assert re.fullmatch(r"\d+\.\d+\.\d+", pyreducer.__version__)


def test_wrapper_defaults_come_from_the_reducer_options():
    import inspect

    from pyreducer._ext import _C

    default = inspect.signature(pyreducer.DistributedDataParallel).parameters[
        "timeline_iterations"].default
    assert default == _C.ReducerOptions().timeline_iterations
    options = _C.ReducerOptions()
    assert options.rebuild_buckets is True  # torch DDP's schedule unless told otherwise
    assert options.rebuild_caps_bytes == [_C.DEFAULT_FIRST_BUCKET_CAP_BYTES,
                                          _C.DEFAULT_BUCKET_CAP_BYTES]


@pytest.mark.parametrize("module", ["pyreducer.observe.plot", "pyreducer.tools.simulate"])
def test_plots_never_switch_the_backend(module):
    source = open(os.path.join(os.path.dirname(PACKAGE), *module.split(".")) + ".py").read()
    assert not re.search(r"^\s*(matplotlib\.use\(|import matplotlib\.pyplot|"
                         r"from matplotlib import pyplot)", source, re.M)
