"""pyreducer's version: stated here only (pyproject.toml reads it; pyreducer.__version__ re-exports it)."""
__version__ = "0.1.0"
