"""Loads the compiled core, pyreducer._C, with a clear error when it has not been built."""
import torch  # noqa: F401  (the extension has no rpath to torch's libraries: torch must load first)

try:
    from pyreducer import _C
except ImportError as error:  # pragma: no cover - exercised only on a broken install
    raise ImportError(
        "pyreducer's compiled extension pyreducer._C could not be imported "
        f"({error}). Build it with `make build` (or `pip install --no-build-isolation .` "
        "in an environment that has torch), against the torch you import now "
        f"(torch {torch.__version__})."
    ) from error

__all__ = ["_C"]
