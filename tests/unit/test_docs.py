"""The documentation kept true to the code: every Python block in the README and the pages is
run or says why not (pyreducer/testing/docs_code.py); the options table is the constructor's
signature; every environment variable the code reads is on its page; every Note named in the
sources exists; the README stays a front door; pictures stay small. The site itself is built
by `make docs` (mkdocs build --strict: links, references, docstrings)."""
import glob
import importlib.util
import inspect
import os
import re

import pytest

import pyreducer
from pyreducer.testing import docs_code

# The checkout's (the imported pyreducer may be an installed copy: make cuda-check)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGES = os.path.join(REPO, "docs", "pages")
README_MAX_CHARS = 10_000
PICTURE_MAX_BYTES = 200 * 1024


def _hooks():
    """docs/hooks.py, loaded alone (its source readers import nothing of MkDocs)."""
    spec = importlib.util.spec_from_file_location("docs_hooks", os.path.join(REPO, "docs",
                                                                             "hooks.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _page(*parts) -> str:
    return open(os.path.join(PAGES, *parts), encoding="utf-8").read()


def test_every_python_block_is_run_or_says_why_not():
    blocks = docs_code.all_blocks(REPO)
    assert len(blocks) > 20  # the scan finds the blocks
    unmarked = [f"{b['file']}:{b['line']}" for b in blocks if b["kind"] == "unmarked"]
    assert not unmarked, f"python blocks with no snippet/fragment/not-run marker: {unmarked}"
    silent = [f"{b['file']}:{b['line']}" for b in blocks
              if b["kind"] == "not-run" and len(b["label"]) < 10]
    assert not silent, f"not-run blocks must say why (at least a few words): {silent}"


def test_snippet_names_are_unique():
    names = [b["label"] for b in docs_code.all_blocks(REPO) if b["kind"] == "snippet"]
    assert names and len(names) == len(set(names)), sorted(names)


def test_the_readme_is_a_front_door():
    text = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    assert len(text) <= README_MAX_CHARS, f"README.md: {len(text)} characters, expected at " \
                                          f"most {README_MAX_CHARS}"
    for page in ("getting-started.md", "guides/troubleshooting.md", "reference/ddp.md",
                 "design/how-it-works.md", "benchmarks.md"):
        assert f"docs/pages/{page}" in text, f"the README's map does not link {page}"


@pytest.mark.parametrize("path", docs_code.doc_files(REPO) + [
    os.path.join(REPO, "benchmarks", "results", "README.md")], ids=os.path.basename)
def test_pages_carry_no_development_history(path):
    text = open(path, encoding="utf-8").read()
    found = re.findall(r"\b(?:issues? #?\d+|this session|last session|sessions? ago)\b", text,
                       re.I)
    assert not found, f"{os.path.relpath(path, REPO)}: {found} (history belongs in records " \
                      f"and commits)"


def _options_table() -> list[tuple[str, str]]:
    """(name, default) of each row of the constructor options table."""
    rows = re.findall(r"^\| `(\w+)` \| `([^`]*)`", _page("reference", "options.md"), re.M)
    assert rows, "reference/options.md has no option rows"
    return rows


# Defaults that follow the installed torch's DDP (pyreducer/wrapper/torch_versions.py): the table
# gives the newest supported torch's and says what older ones use.
VERSION_DEFAULTS = {"broadcast_buffers": ("None", "True")}  # torch 2.13+, torch 2.11-2.12


def test_the_options_table_is_the_constructor_signature():
    signature = inspect.signature(pyreducer.DistributedDataParallel)
    expected = [(name, "required" if p.default is inspect.Parameter.empty else repr(p.default))
                for name, p in signature.parameters.items()]
    table = _options_table()
    assert [name for name, _ in table] == [name for name, _ in expected]
    for (name, documented), (_, default) in zip(table, expected):
        if name in VERSION_DEFAULTS:
            newest, older = VERSION_DEFAULTS[name]
            assert documented == newest and default in (newest, older), (name, default)
            assert f"the default is `{older}`" in _page("reference", "options.md"), name
        else:
            assert documented == default, f"{name}: the table says {documented}, the " \
                                          f"signature {default}"


# How the code reads an environment variable: os.environ.get("X"), os.environ["X"],
# os.getenv("X"), or a constant NAME_ENV = "X" that is read so.
_ENV_READ = re.compile(r"""(?:environ(?:\.get)?\(?\[?|getenv\(|_ENV\s*=\s*)\s*["']([A-Z][A-Z0-9_]+)["']""")
_ENV_NOT_OURS = {"PATH", "PYTHONPATH", "MASTER_ADDR", "WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT",
                 "TEMP_DIR", "BACKEND", "GLOO_SOCKET_IFNAME"}  # set for children, or torchrun's


def _environment_read() -> set[str]:
    paths = glob.glob(os.path.join(REPO, "pyreducer", "**", "*.py"), recursive=True)
    paths = [p for p in paths if os.sep + "testing" + os.sep not in p]
    names = set()
    for path in paths + [os.path.join(REPO, "setup.py")]:
        names |= set(_ENV_READ.findall(open(path, encoding="utf-8").read()))
    return names - _ENV_NOT_OURS


def test_every_environment_variable_read_is_documented():
    read = _environment_read()
    assert {"PYREDUCER_TRACE", "PYREDUCER_TUNING_CACHE", "PYREDUCER_CUDA"} <= read  # scan works
    page = _page("reference", "environment.md")
    documented = set(re.findall(r"^\| `([A-Z][A-Z0-9_]+)`", page, re.M))
    assert read - documented == set(), f"read by the code, not on the page: {read - documented}"
    stale = {n for n in documented if n.startswith("PYREDUCER_")} - read
    assert not stale, f"on the page, read nowhere: {stale}"


def test_every_note_named_in_the_sources_is_defined_once():
    hooks = _hooks()
    notes = hooks.notes()
    titles = [n["title"] for n in notes]
    assert len(titles) > 25 and len(titles) == len(set(titles)), sorted(titles)
    missing = {t: where for t, where in hooks.note_references().items() if t not in titles}
    assert not missing, f"Notes named but never defined: {missing}"
    empty = [n["title"] for n in notes if len(n["summary"]) < 20]
    assert not empty, f"Notes whose first sentence the index cannot read: {empty}"


def test_the_notes_index_and_the_command_line_are_generated():
    hooks = _hooks()
    assert "<!-- generated: notes -->" in _page("design", "notes.md")
    assert "<!-- generated: cli -->" in _page("reference", "cli.md")
    table = hooks.notes_markdown()
    assert "| **Overlapped step**<br>`pyreducer/overlap/optimizer.py:" in table
    assert not re.search(r"\bissues? #?\d+", table, re.I), "a Note's first sentence names an issue"
    cli = hooks.cli_markdown()
    for command in ("demo", "trace", "report", "simulate", "netem", "fuzz", "soak"):
        assert f"## `{command}`" in cli and f"python -m pyreducer {command}" in cli


def test_pictures_are_small():
    pictures = glob.glob(os.path.join(PAGES, "**", "*.png"), recursive=True)
    assert pictures, "the pages have no pictures (make docs-figures writes them)"
    big = [f"{os.path.relpath(p, REPO)} ({os.path.getsize(p) // 1024} KiB)" for p in pictures
           if os.path.getsize(p) > PICTURE_MAX_BYTES]
    assert not big, f"pictures over {PICTURE_MAX_BYTES // 1024} KiB: {big}"


def test_the_docs_packages_are_the_docs_extras_pins():
    """make docs installs the Makefile's DOCS_PACKAGES: the versions pyproject's docs extra pins."""
    makefile = open(os.path.join(REPO, "Makefile")).read()
    installed = re.search(r"^DOCS_PACKAGES := ((?:.*\\\n)*.*)$", makefile, re.M).group(1)
    installed = installed.replace("\\\n", " ").split()
    extra = re.search(r"^docs = \[(.*?)\]$", open(os.path.join(REPO, "pyproject.toml")).read(),
                      re.M | re.S).group(1)
    pinned = [p.strip().strip('"') for p in extra.replace("\n", " ").split(",") if "==" in p]
    assert len(installed) >= 4 and sorted(installed) == sorted(pinned), (installed, pinned)


def test_lists_start_after_a_blank_line():
    """Python-Markdown runs a list that follows a paragraph line into the paragraph (GitHub
    does not): the pages leave a blank line before every list (the records are loosened by the
    site's hook instead)."""
    hooks = _hooks()
    glued = []
    for path in docs_code.doc_files(REPO):
        text = open(path, encoding="utf-8").read()
        loosened = hooks.loosen_lists(text, nested_indent=4).split("\n")
        for number, (line, fixed) in enumerate(zip(text.split("\n"), loosened), start=1):
            if line != fixed:
                glued.append(f"{os.path.relpath(path, REPO)}:{number}")
                break
    assert not glued, f"a list right after a paragraph line (add a blank line): {glued}"
