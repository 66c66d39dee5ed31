"""Logging set-up for the programs (never called by library code), and :func:`printable`,
the one escaping of peer-supplied text for log lines, status output and metrics labels."""

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


_SHORT_ESCAPES = {"\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def printable(text: str, limit: int = 256) -> str:
    """``text`` from the wire made safe to log or show: every character that is not
    printable (newlines and other control characters, invisible format characters, and the
    surrogate escapes of bytes that were not UTF-8) becomes a visible backslash escape, and
    backslash itself is doubled, so one peer string is one unambiguous run of text on one
    line.  More than ``limit`` characters are cut with "...".  Printable text (every valid
    NQN) comes back unchanged."""
    if len(text) > limit:
        return printable(text[:limit], limit) + "..."
    if text.isprintable() and "\\" not in text:
        return text
    out = []
    for ch in text:
        if ch.isprintable() and ch != "\\":
            out.append(ch)
        elif ch in _SHORT_ESCAPES:
            out.append(_SHORT_ESCAPES[ch])
        else:
            code = ord(ch)
            if 0xDC80 <= code <= 0xDCFF:        # a byte that was not UTF-8, as itself
                code -= 0xDC00
            out.append(f"\\x{code:02x}" if code < 0x100 else
                       f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
    return "".join(out)
