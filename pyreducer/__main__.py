"""`python -m pyreducer demo | trace` (see pyreducer/cli.py)."""
import sys

from pyreducer.tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
