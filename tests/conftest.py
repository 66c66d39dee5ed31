"""Run-wide summaries, printed by the process that prints the run's report.

Under pytest-xdist (``make test`` runs test files on several workers) a test's fixtures run
in a worker, so a summary gathered in a module-level list there would never reach the
terminal.  Suites put their rows in the test's ``user_properties`` instead (they travel with
the test's reports); this hook, which runs where the reports are printed, collects them."""

from __future__ import annotations

import pytest

BYSTANDER_RATES: list[tuple] = []


def pytest_runtest_logreport(report):
    if report.when != "teardown":
        return
    for name, value in report.user_properties:
        if name == "bystander_rate":
            BYSTANDER_RATES.append(tuple(value))


def pytest_terminal_summary(terminalreporter):
    if not BYSTANDER_RATES:
        return
    terminalreporter.section("hostile peers: the bystander's I/O rate")
    terminalreporter.write_line(f"{'test / attack':72} {'before/s':>9} {'during/s':>9} "
                                f"{'max gap s':>9}")
    for test, attack, before, during, gap in BYSTANDER_RATES:
        terminalreporter.write_line(f"{(test + ' / ' + attack)[:72]:72} {before:9.0f} "
                                    f"{during:9.0f} {gap:9.2f}")


def pytest_collection_modifyitems(config, items):
    """Skip the tests marked ``needs_transport(name, why)`` (they speak that transport's wire
    themselves) when the run's BLOCKFABRIC_TEST_TRANSPORTS does not name it; ``make test``
    runs rdma and tcp, so nothing is skipped there."""
    from e2e.conftest import TRANSPORTS
    for item in items:
        for mark in item.iter_markers("needs_transport"):
            name, why = mark.args
            if name not in TRANSPORTS:
                item.add_marker(pytest.mark.skip(
                    reason=f"only over {name} (BLOCKFABRIC_TEST_TRANSPORTS="
                           f"{','.join(TRANSPORTS)}): {why}"))
