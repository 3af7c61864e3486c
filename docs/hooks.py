"""MkDocs hooks: what the site takes from the code and the records rather than from pages.

- The benchmark records (benchmarks/results/: pages, plots, JSON) are served under results/, so
  that a claim links to the record that measured it and the site's search finds it.
- `<!-- generated: cli -->` in a page becomes the help of every `python -m pyreducer` command,
  from the parsers themselves.
- `<!-- generated: notes -->` becomes the index of the Notes (title, file, first sentence),
  read from the sources.
The functions that read the sources import nothing of MkDocs, so the tests use them as well
(tests/unit/test_docs.py).
"""
from __future__ import annotations

import glob
import os
import re

DOCS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(DOCS)
RECORDS = os.path.join(REPO, "benchmarks", "results")
RECORDS_URL = "results"  # where the records appear in the site
CLI_COLUMNS = 90  # the width the command-line help is wrapped at (the pages fit about 95)

# A Note is defined by a line that holds only its title: `// Note [Title]` in C++,
# `Note [Title]` in a docstring or `# Note [Title]` in Python; everything else naming one refers.
NOTE_DEFINITION = re.compile(r"^\s*(?://|#)?\s*Note \[([^\]]+)\]\s*$")
NOTE_REFERENCE = re.compile(r"Note \[([^\]]+)\]")
NOTE_SOURCES = ("csrc/**/*.h", "csrc/**/*.cpp", "csrc/**/*.cu", "pyreducer/**/*.py")


def _source_files() -> list[str]:
    paths = []
    for pattern in NOTE_SOURCES:
        paths += glob.glob(os.path.join(REPO, pattern), recursive=True)
    return sorted(paths)


def _strip_comment(line: str) -> str:
    return re.sub(r"^\s*(//|#)\s?", "", line).strip()


SUMMARY_MAX_CHARS = 240  # the Notes index shows at most this much of a Note's first sentence
_SENTENCE_END = re.compile(r"(?<![\s\d])(?<!\be\.g)(?<!\bi\.e)(?<!\bvs)\.(\s|$)")
_ITEM = re.compile(r"^\s*(-|\d+\.)\s+")


def _first_sentence(lines: list[str]) -> str:
    """What a Note says first, for its line in the index: its first sentence (the lines up to
    the first blank one or list, cut after the first full stop that ends a sentence: not one
    inside a name such as torch.compile or after a number), shortened at a clause boundary to
    SUMMARY_MAX_CHARS."""
    words = []
    for line in lines:
        text = _strip_comment(line).strip('"')
        if not text or (words and (_ITEM.match(text) or re.search(r"\S {2,}\S", text))):
            break  # a list, or a table of names and meanings, follows the sentence
        words.append(_ITEM.sub("", text) if not words else text)
    paragraph = " ".join(words)
    match = _SENTENCE_END.search(paragraph)
    sentence = paragraph[:match.start() + 1] if match else paragraph
    if sentence.endswith(":"):
        sentence = sentence[:-1] + "."
    if len(sentence) > SUMMARY_MAX_CHARS:
        cut = max(sentence.rfind(mark, 0, SUMMARY_MAX_CHARS) for mark in ("; ", ": ", ", "))
        sentence = sentence[:cut if cut > 80 else SUMMARY_MAX_CHARS].rstrip() + " ..."
    return sentence


def notes() -> list[dict]:
    """Every Note defined in the sources: {"title", "file" (relative to the repository),
    "line", "summary"}, in file order."""
    found = []
    for path in _source_files():
        lines = open(path, encoding="utf-8").read().splitlines()
        for i, line in enumerate(lines):
            match = NOTE_DEFINITION.match(line)
            if match:
                found.append({"title": match.group(1), "file": os.path.relpath(path, REPO),
                              "line": i + 1, "summary": _first_sentence(lines[i + 1:])})
    return found


def note_references() -> dict[str, list[str]]:
    """{title: ["file:line", ...]} of every Note named anywhere in the sources."""
    refs: dict[str, list[str]] = {}
    for path in _source_files():
        for i, line in enumerate(open(path, encoding="utf-8").read().splitlines()):
            for title in NOTE_REFERENCE.findall(line):
                refs.setdefault(title, []).append(f"{os.path.relpath(path, REPO)}:{i + 1}")
    return refs


def notes_markdown() -> str:
    rows = ["| Note | What it says first |", "|---|---|"]
    for note in sorted(notes(), key=lambda n: n["title"].lower()):
        summary = note["summary"].replace("|", "\\|")
        rows.append(f"| **{note['title']}**<br>`{note['file']}:{note['line']}` | {summary} |")
    return "\n".join(rows)


def cli_markdown() -> str:
    """The help of `python -m pyreducer` and of each of its commands, as the parsers print it."""
    os.environ["COLUMNS"] = str(CLI_COLUMNS)  # argparse wraps at the terminal's width
    from pyreducer.tools.cli import build_parser

    parser = build_parser()
    parser.prog = "python -m pyreducer"
    sections = [f"```text\n{parser.format_help()}```"]
    commands = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    for name, sub in commands.choices.items():
        sub.prog = f"python -m pyreducer {name}"
        sections.append(f"## `{name}`\n\n```text\n{sub.format_help()}```")
    return "\n\n".join(sections)


GENERATED = {"cli": cli_markdown, "notes": notes_markdown}
_LIST_ITEM = re.compile(r"^(\s*)([-*+]|\d+\.)\s")


def loosen_lists(markdown: str, nested_indent: int = 2) -> str:
    """Lists as GitHub reads them, for Python-Markdown: a list may follow a paragraph line
    directly (a blank line is put before it), and with nested_indent=2 a list nests by two
    spaces (its indents are doubled, to Python-Markdown's four). Code fences are left alone."""
    out, fenced, in_list = [], False, False
    for line in markdown.split("\n"):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            item = _LIST_ITEM.match(line)
            if item and not in_list and out and out[-1].strip() \
                    and not out[-1].lstrip().startswith("|"):
                out.append("")
            if not line.strip():
                in_list = False
            elif item:
                in_list = True
            if in_list and nested_indent == 2 and line.startswith(" "):
                indent = len(line) - len(line.lstrip(" "))
                line = " " * (2 * indent) + line.lstrip(" ")
        out.append(line)
    return "\n".join(out)


def on_page_markdown(markdown, page, config, files):
    def expand(match):
        return GENERATED[match.group(1)]()
    markdown = re.sub(r"<!-- generated: (\w+) -->", expand, markdown)
    if page.file.src_uri.startswith(RECORDS_URL + "/"):
        # the records are written as GitHub reads Markdown (lists nest by two spaces); the
        # pages are written for Python-Markdown, and their `:::` options hold YAML lists
        markdown = loosen_lists(markdown, nested_indent=2)
    return markdown


def on_files(files, config):
    from mkdocs.structure.files import File

    for path in sorted(glob.glob(os.path.join(RECORDS, "**", "*"), recursive=True)):
        if os.path.isfile(path):
            rel = os.path.relpath(path, RECORDS)
            files.append(File(f"{RECORDS_URL}/{rel}", src_dir=os.path.dirname(RECORDS),
                              dest_dir=config["site_dir"],
                              use_directory_urls=config["use_directory_urls"]))
    return files
