"""Logging set-up for the programs (never called by library code), and :func:`printable`,
the one escaping of peer-supplied text for log lines, status output and metrics labels."""

from __future__ import annotations

import logging
import os
import sys

FORMAT = "%(levelname)s %(name)s: %(message)s"

#: syslog priorities (sd-daemon(3)): what journald records as PRIORITY= for a "<N>" prefix.
PRIORITIES = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3,
              logging.CRITICAL: 2}


def to_journal(stream) -> bool:
    """True when ``stream`` is systemd's stream to the journal: $JOURNAL_STREAM names its
    device and inode (systemd.exec(5)); a redirection to a file or a pipe does not match."""
    try:
        dev, ino = (int(part) for part in os.environ["JOURNAL_STREAM"].split(":"))
        st = os.fstat(stream.fileno())
    except (KeyError, ValueError, OSError, AttributeError):
        return False
    return (st.st_dev, st.st_ino) == (dev, ino)


class JournalFormatter(logging.Formatter):
    """Each line with its syslog priority as a "<N>" prefix, which journald strips and keeps
    as the entry's PRIORITY= (so `journalctl -p warning` finds the warnings)."""

    def format(self, record: logging.LogRecord) -> str:
        prefix = f"<{PRIORITIES.get(record.levelno, 6 if record.levelno < 30 else 3)}>"
        return "\n".join(prefix + line for line in super().format(record).splitlines())


def setup_logging(verbose: int = 0, stream=None, level: int = logging.INFO) -> None:
    """Log to stderr, one line per event; journald adds the timestamps (and, when stderr is
    the journal, takes each line's priority from its prefix).  ``verbose`` > 0 means debug;
    otherwise ``level``."""
    level = logging.DEBUG if verbose > 0 else level
    stream = stream or sys.stderr
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JournalFormatter(FORMAT) if to_journal(stream)
                         else logging.Formatter(FORMAT))
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
