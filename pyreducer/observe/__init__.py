"""Seeing a run (not imported by `import pyreducer`): every rank's timeline gathered into one
Chrome trace (trace.py), plots (plot.py, needs matplotlib: `pip install .[plot]`), the report a
run leaves behind (report.py), and PYREDUCER_TRACE, which records any training script with no
code change (recorder.py)."""


class InputError(Exception):
    """A file or folder a command cannot use; the message says what it expected and which command
    produces it (the command line prints it as one line, without a traceback)."""
