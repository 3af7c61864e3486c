"""The command line as a new user meets it: every option explains itself (what, unit, choices),
and a file or folder a command cannot use gets one line saying which command produces it, not a
traceback."""
import argparse
import subprocess
import sys

import pytest

from pyreducer.testing import subprocess_env
from pyreducer.tools.cli import build_parser, main


def _subcommands():
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices


@pytest.mark.parametrize("command", sorted(_subcommands()))
def test_every_option_has_help(command):
    parser = _subcommands()[command]
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        name = "/".join(action.option_strings) or action.dest
        assert action.help and len(action.help) > 15, f"{command} {name}: no help text"
        if action.option_strings and action.default not in (None, argparse.SUPPRESS) \
                and action.choices is None:
            assert "default" in action.help, f"{command} {name}: default not stated"
        if action.type in (int, float) and action.option_strings:
            assert action.metavar, f"{command} {name}: no metavar naming its unit"


def test_units_are_named():
    text = {c: p.format_help() for c, p in _subcommands().items()}
    assert "SECONDS" in text["trace"] and "SECONDS" in text["netem"] and "MIB" in text["trace"]
    assert "bits per second" in text["netem"] and "bits per second" in text["simulate"]
    assert "{cnn,deep_narrow,demo,mlp,mlp_large,resnet,tied,transformer,vgg,vgg_bn}" in text["trace"]


def _cli(args, cwd):
    env = subprocess_env()
    return subprocess.run([sys.executable, "-m", "pyreducer"] + args, capture_output=True,
                          text=True, timeout=120, cwd=str(cwd), env=env)


@pytest.mark.parametrize("args,producer", [
    (["simulate", "--profile", "run/demo"], "make demo"),
    (["simulate", "--profile", "empty"], "PYREDUCER_TRACE"),
    (["simulate", "--profile", "bad.json"], "python -m pyreducer trace"),
    (["report", "empty"], "PYREDUCER_TRACE=empty torchrun"),
    (["simulate", "--profile", "profile.json", "--ranks", "2,x"], "--ranks expects"),
    (["trace", "--out", "bad.json"], "--out bad.json: a file is in the way"),
    (["demo", "--out", "bad.json"], "--out bad.json: a file is in the way"),
    (["simulate", "--profile", "profile.json", "--out", "bad.json/sim.png"],
     "a file is in the way"),
])
def test_unusable_input_is_one_line_naming_the_producer(tmp_path, monkeypatch, capsys, args,
                                                       producer):
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad.json").write_text('{"ready_ms": [1.0]}')  # not a whole profile
    (tmp_path / "profile.json").write_text(
        '{"ready_ms": [1.0], "size_bytes": [4], "backward_ms": 1.0}')
    monkeypatch.chdir(tmp_path)
    assert main(args) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"python -m pyreducer {args[0]}: error: ")
    assert producer in lines[0]


def test_the_entry_point_prints_no_traceback(tmp_path):
    result = _cli(["simulate", "--profile", "run/demo"], tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.count("\n") == 1 and "make demo" in result.stderr
