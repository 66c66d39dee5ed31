"""Logging set-up for the programs (never called by library code)."""

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
