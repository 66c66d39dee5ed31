"""Log lines carry their syslog priority ("<4>WARNING ...") only when stderr is the journal
($JOURNAL_STREAM names it), so journalctl -p warning finds the warnings; elsewhere (a
terminal, a file, a pipe) they stay plain."""

from __future__ import annotations

import logging
import os

from blockfabric.logutil import setup_logging


def _log_to(path, monkeypatch, journal_stream: str | None) -> str:
    if journal_stream is None:
        monkeypatch.delenv("JOURNAL_STREAM", raising=False)
    else:
        monkeypatch.setenv("JOURNAL_STREAM", journal_stream)
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    with open(path, "w") as stream:
        st = os.fstat(stream.fileno())
        if journal_stream == "match":
            monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
        try:
            setup_logging(stream=stream)
            log = logging.getLogger("blockfabric.test")
            log.info("ready: 1 listener(s)")
            log.warning("access denied: hostnqn=%s subnqn=%s", "h", "s")
            try:
                raise ValueError("boom")
            except ValueError:
                log.exception("reload rejected")
        finally:
            root.handlers[:], root.level = saved
    return path.read_text()


def test_journal_stream_gets_priorities(tmp_path, monkeypatch):
    text = _log_to(tmp_path / "log", monkeypatch, "match")
    lines = text.splitlines()
    assert lines[0] == "<6>INFO blockfabric.test: ready: 1 listener(s)"
    assert lines[1] == "<4>WARNING blockfabric.test: access denied: hostnqn=h subnqn=s"
    assert lines[2] == "<3>ERROR blockfabric.test: reload rejected"
    # every line of a traceback keeps the priority (journald stores each line as an entry)
    assert len(lines) > 4 and all(line.startswith("<3>") for line in lines[2:])


def test_other_streams_stay_plain(tmp_path, monkeypatch):
    for value in (None, "1:2", "garbage"):
        text = _log_to(tmp_path / "log", monkeypatch, value)
        assert text.startswith("INFO blockfabric.test: ready"), (value, text)
        assert "<" not in text.split("\n")[1], (value, text)
