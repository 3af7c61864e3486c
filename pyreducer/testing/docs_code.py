"""The Python code blocks of the README and the documentation pages, and how the tests run them.

Every ```python block is marked by the line just above it:
  <!-- snippet: NAME -->     a whole script: run under torchrun with 2 Gloo ranks on CPU; it
                             prints `params <checksum>` once per rank and the ranks must agree
                             (tests/multirank/test_coming_from.py);
  <!-- fragment -->          part of a training script: a page's fragments run in order, in one
                             namespace, on 2 spawned Gloo ranks, after FRAGMENT_PRELUDE; then
                             the ranks' parameters must agree (tests/multirank/test_docs_code.py);
  <!-- not-run: REASON -->   shown, not run here, with the reason (a GPU, several hosts).
An unmarked block fails tests/unit/test_docs.py.
"""
from __future__ import annotations

import glob
import os
import re

_BLOCK = re.compile(r"^```python[^\n]*\n(.*?)^```", re.M | re.S)
_MARKER = re.compile(r"<!-- (snippet|fragment|not-run)(?:: (.*?))? -->\s*$")

# What a fragment may use without defining it: a small classifier not yet wrapped (`model`),
# its optimizer's absence (fragments make one), six batches of this rank's data (`loader`),
# and the usual imports. The process group is up (Gloo, 2 ranks); the working directory is a
# fresh temporary folder.
FRAGMENT_PRELUDE = """
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import pyreducer
from pyreducer import DistributedDataParallel as DDP

rank, world_size = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                      nn.Linear(64, 10))
_data = torch.Generator().manual_seed(100 + rank)
loader = [(torch.randn(16, 32, generator=_data), torch.randint(0, 10, (16,), generator=_data))
          for _ in range(6)]
loss_fn = nn.CrossEntropyLoss()
"""


def doc_files(repo: str) -> list[str]:
    """The README and every documentation page of the checkout `repo` (the tests pass theirs:
    the package they import may be an installed copy); the benchmark records are not pages
    here."""
    pages = sorted(glob.glob(os.path.join(repo, "docs", "pages", "**", "*.md"), recursive=True))
    return [os.path.join(repo, "README.md")] + pages


def blocks(path: str, repo: str) -> list[dict]:
    """The ```python blocks of one Markdown file: {"file" (relative to `repo`), "line",
    "kind" ("snippet", "fragment", "not-run" or "unmarked"), "label" (a snippet's name, a
    not-run reason), "code"}."""
    text = open(path, encoding="utf-8").read()
    found = []
    for match in _BLOCK.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        above = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = _MARKER.search(above)
        found.append({"file": os.path.relpath(path, repo), "line": line,
                      "kind": marker.group(1) if marker else "unmarked",
                      "label": (marker.group(2) or "").strip() if marker else "",
                      "code": match.group(1)})
    return found


def all_blocks(repo: str) -> list[dict]:
    return [b for path in doc_files(repo) for b in blocks(path, repo)]


def snippets(repo: str) -> dict[str, str]:
    """{name: code} of every snippet in the README and the pages."""
    return {b["label"]: b["code"] for b in all_blocks(repo) if b["kind"] == "snippet"}


def fragments_by_page(repo: str) -> dict[str, list[dict]]:
    pages: dict[str, list[dict]] = {}
    for b in all_blocks(repo):
        if b["kind"] == "fragment":
            pages.setdefault(b["file"], []).append(b)
    return pages


def fragment_worker(rank, world_size, page, fragments, workdir):
    """One rank of a page's fragments: the prelude, then each fragment in order in one
    namespace; returns a checksum of the wrapped model's parameters (or of `model`'s)."""
    import torch

    os.chdir(workdir)
    namespace: dict = {"__name__": "__docs__"}
    exec(compile(FRAGMENT_PRELUDE, "<prelude>", "exec"), namespace)
    for fragment in fragments:
        where = f"{page}:{fragment['line']}"
        try:
            exec(compile(fragment["code"], where, "exec"), namespace)
        except BaseException as error:
            raise RuntimeError(f"the fragment at {where} raised on rank {rank}: "
                               f"{type(error).__name__}: {error}") from error
    model = namespace["model"]
    with torch.no_grad():
        return float(sum(p.double().sum() for p in model.parameters()))
