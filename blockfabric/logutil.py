"""Logging set-up for the programs (never called by library code)."""

from __future__ import annotations

import logging
import sys

FORMAT = "%(levelname)s %(name)s: %(message)s"


def setup_logging(verbose: int = 0, stream=None, level: int = logging.INFO) -> None:
    """Log to stderr, one line per event; journald adds the timestamps.  ``verbose`` > 0
    means debug; otherwise ``level``."""
    level = logging.DEBUG if verbose > 0 else level
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
