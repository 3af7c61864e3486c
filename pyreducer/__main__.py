"""`python -m pyreducer COMMAND` (see pyreducer/tools/cli.py)."""
import sys

from pyreducer.tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
