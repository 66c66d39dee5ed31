"""The host controller's states as data (initiator/recovery.py's CTRL_TRANSITIONS): the
rules the reconnect code relies on, checked on the table itself (the behaviour is tested
end to end in tests/faults/test_reconnect.py)."""

from __future__ import annotations

from blockfabric.initiator.host import CTRL_TRANSITIONS, CtrlEvent, CtrlState, Recovery


def test_only_a_live_controller_starts_reconnecting_when_lost():
    # a loss seen while connecting, reconnecting, failed or closed changes nothing: one
    # reconnect loop at a time, and none for a controller that is over
    assert [s for s in CtrlState if (s, CtrlEvent.LOST) in CTRL_TRANSITIONS] == [CtrlState.LIVE]
    assert CTRL_TRANSITIONS[CtrlState.LIVE, CtrlEvent.LOST] is CtrlState.RECONNECTING


def test_every_state_but_closed_closes_and_closed_is_final():
    for state in CtrlState:
        if state is not CtrlState.CLOSED:
            assert CTRL_TRANSITIONS[state, CtrlEvent.CLOSE] is CtrlState.CLOSED, state
    assert not [key for key in CTRL_TRANSITIONS if key[0] is CtrlState.CLOSED]


def test_reconnecting_ends_live_or_failed_and_failed_stays_failed():
    assert CTRL_TRANSITIONS[CtrlState.RECONNECTING, CtrlEvent.RECONNECTED] is CtrlState.LIVE
    assert CTRL_TRANSITIONS[CtrlState.RECONNECTING, CtrlEvent.GAVE_UP] is CtrlState.FAILED
    assert [e for (s, e) in CTRL_TRANSITIONS if s is CtrlState.FAILED] == [CtrlEvent.CLOSE]


def test_move_applies_the_table_and_ignores_what_it_does_not_name():
    class Ctrl(Recovery):
        state = CtrlState.CONNECTING

    ctrl = Ctrl()
    assert not ctrl._move(CtrlEvent.LOST) and ctrl.state is CtrlState.CONNECTING
    assert ctrl._move(CtrlEvent.CONNECTED) and ctrl.state is CtrlState.LIVE
    assert ctrl._move(CtrlEvent.LOST) and ctrl.state is CtrlState.RECONNECTING
    assert not ctrl._move(CtrlEvent.LOST) and ctrl.state is CtrlState.RECONNECTING
    assert ctrl._move(CtrlEvent.GAVE_UP) and ctrl.state is CtrlState.FAILED
    assert not ctrl._move(CtrlEvent.RECONNECTED) and ctrl.state is CtrlState.FAILED
    assert ctrl._move(CtrlEvent.CLOSE) and ctrl.state is CtrlState.CLOSED
