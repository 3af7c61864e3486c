"""Seeing a run (not imported by `import pyreducer`): every rank's timeline gathered into one
Chrome trace (trace.py), plots (plot.py, needs matplotlib: `pip install .[plot]`), the report a
run leaves behind (report.py), and PYREDUCER_TRACE, which records any training script with no
code change (recorder.py)."""


class InputError(Exception):
    """A file or folder a command cannot use; the message says what it expected and which command
    produces it (the command line prints it as one line, without a traceback)."""


def output_dir(path, option: str) -> str:
    """Makes folder `path` for a command's output (option names the command-line option that
    gave it); InputError if a file is in the way."""
    import os

    if os.path.exists(path) and not os.path.isdir(path):
        raise InputError(f"{option} {path}: a file is in the way; give a folder "
                         "(it is created if missing)")
    os.makedirs(path, exist_ok=True)
    return path
