"""Seeing a run (not imported by `import pyreducer`): every rank's timeline gathered into one
Chrome trace (trace.py), plots (plot.py, needs matplotlib: `pip install .[plot]`), the report a
run leaves behind (report.py), and PYREDUCER_TRACE, which records any training script with no
code change (recorder.py)."""
