"""The controller state machine: section 9's register dance and every queue-connect rule."""

from __future__ import annotations

import pytest

from blockfabric.protocol import (
    CC_TRANSITIONS, COMMAND_RULES, CSTS, IATTR, SQE, AdminOpcode, CommandClass,
    ConnectCommand, ConnectData, ControllerState, FabricsType, NumberOfQueues, Phase,
    PropertyGet, PropertySet, ProtocolError, QueueState, ShutdownStatus, StatusCode, admit,
    connect_invalid_param_result)

HOST = "nqn.2014-08.org.nvmexpress:uuid:0000"


def admin(sqsize: int = 31, kato: int = 5000, max_io_queues: int = 4) -> ControllerState:
    return ControllerState.admin_connect(ConnectCommand(qid=0, sqsize=sqsize, kato=kato),
                                         ConnectData(hostnqn=HOST), cntlid=1,
                                         max_io_queues=max_io_queues)


def prop_set(state: ControllerState, value: int) -> ControllerState:
    return state.property_set(PropertySet(attrib=0, offset=0x14, value=value))


def csts(state: ControllerState) -> int:
    return state.property_get(PropertyGet(attrib=0, offset=0x1C))


def ready() -> ControllerState:
    return prop_set(prop_set(admin(), 0x00460060), 0x00460061)


def test_linux_enable_and_shutdown_sequence() -> None:
    """Section 9: CAP, CC EN=0, CC, CAP, CC EN=1, CSTS until RDY, VS; then SHN=01 until
    SHST=2."""
    s = admin()
    assert s.property_get(PropertyGet(attrib=1, offset=0)) == s.cap.to_int()
    s = prop_set(s, 0x00460060)
    assert csts(s) == 0 and s.property_get(PropertyGet(offset=0x14)) == 0x00460060
    s = prop_set(s, 0x00460061)
    assert csts(s) == 1 and s.phase is Phase.READY
    assert s.property_get(PropertyGet(offset=0x08)) == 0x00010300
    s = prop_set(s, 0x00464061)
    assert CSTS.from_int(csts(s)) == CSTS(shst=ShutdownStatus.IN_PROGRESS)
    s = s.shutdown_complete()
    assert CSTS.from_int(csts(s)).shst == ShutdownStatus.COMPLETE and csts(s) == 0x8
    s = prop_set(s, 0x00460060)  # reset after shutdown
    assert csts(s) == 0 and s.phase is Phase.DISABLED


def test_disable_resets_ready() -> None:
    s = prop_set(ready(), 0x00460060)
    assert s.phase is Phase.DISABLED and csts(s) == 0


@pytest.mark.parametrize("cc", [0x00460161,  # mps 2 (16 KiB pages)
                                0x00450061,  # iosqes 5
                                0x00460011,  # css 1
                                0x00460861])  # ams 1
def test_enable_with_unsupported_config_sets_cfs(cc: int) -> None:
    s = prop_set(admin(), cc)
    assert s.phase is Phase.FAILED and CSTS.from_int(csts(s)) == CSTS(cfs=True)
    with pytest.raises(ProtocolError) as info:
        s.admit(SQE(AdminOpcode.IDENTIFY, cid=1), qid=0)
    assert info.value.status == StatusCode.CMD_SEQ_ERROR


def test_shutdown_while_disabled_completes_at_once() -> None:
    s = prop_set(admin(), 0x00464060)
    assert CSTS.from_int(csts(s)).shst == ShutdownStatus.COMPLETE


def test_transition_table_is_data_and_total_over_its_keys() -> None:
    assert all(isinstance(k[0], Phase) and isinstance(v, Phase)
               for k, v in CC_TRANSITIONS.items())
    assert {q for q, _ in COMMAND_RULES} == set(QueueState)
    assert len(COMMAND_RULES) == len(QueueState) * len(CommandClass)


@pytest.mark.parametrize("attrib, offset", [(0, 0x00), (1, 0x14), (0, 0x40), (1, 0x08)])
def test_property_get_of_unknown_or_wrong_size_register(attrib: int, offset: int) -> None:
    with pytest.raises(ProtocolError) as info:
        admin().property_get(PropertyGet(attrib=attrib, offset=offset))
    assert (info.value.status, info.value.dnr) == (StatusCode.INVALID_FIELD, True)


@pytest.mark.parametrize("attrib, offset", [(0, 0x00), (0, 0x1C), (1, 0x14)])
def test_property_set_of_read_only_or_8_byte(attrib: int, offset: int) -> None:
    with pytest.raises(ProtocolError) as info:
        admin().property_set(PropertySet(attrib=attrib, offset=offset, value=1))
    assert info.value.status == StatusCode.INVALID_FIELD


# ------------------------------------------------------------------ command admission

def fabrics(fctype: FabricsType, cid: int = 9) -> SQE:
    return SQE(0x7F, cid=cid, nsid=int(fctype))


def test_non_connect_on_unconnected_queue_is_invalid_opcode() -> None:
    for sqe in (SQE(AdminOpcode.IDENTIFY, cid=3), SQE(0x02, cid=3),
                fabrics(FabricsType.PROPERTY_GET, 3)):
        with pytest.raises(ProtocolError) as info:
            admit(sqe, QueueState.UNCONNECTED)
        assert (info.value.status, info.value.dnr, info.value.cid) == (
            StatusCode.INVALID_OPCODE, True, 3)
    admit(fabrics(FabricsType.CONNECT), QueueState.UNCONNECTED)


def test_admin_commands_before_enable_are_sequence_errors() -> None:
    s = prop_set(admin(), 0x00460060)
    s.admit(fabrics(FabricsType.PROPERTY_GET), qid=0)  # property access always works
    s.admit(fabrics(FabricsType.PROPERTY_SET), qid=0)
    with pytest.raises(ProtocolError) as info:
        s.admit(SQE(AdminOpcode.IDENTIFY, cid=4), qid=0)
    assert (info.value.status, info.value.dnr, info.value.cid) == (
        StatusCode.CMD_SEQ_ERROR, True, 4)
    s = prop_set(s, 0x00460061)
    s.admit(SQE(AdminOpcode.IDENTIFY, cid=4), qid=0)
    s.admit(SQE(0x02, cid=5), qid=1)


def test_connect_or_property_on_a_connected_queue_is_invalid_opcode() -> None:
    s = ready()
    for sqe, qid in ((fabrics(FabricsType.CONNECT), 0), (fabrics(FabricsType.CONNECT), 1),
                     (fabrics(FabricsType.PROPERTY_GET), 1), (SQE(0x7F, nsid=0x7E), 0)):
        with pytest.raises(ProtocolError) as info:
            s.admit(sqe, qid)
        assert info.value.status == StatusCode.INVALID_OPCODE


def test_io_commands_after_shutdown_are_sequence_errors() -> None:
    s = prop_set(ready(), 0x00464061)
    with pytest.raises(ProtocolError) as info:
        s.admit(SQE(0x01), qid=1)
    assert info.value.status == StatusCode.CMD_SEQ_ERROR


# ------------------------------------------------------------------ queue connect rules

def io_connect(state: ControllerState, qid: int, sqsize: int = 127,
               cntlid: int = 1) -> ControllerState:
    return state.io_connect(ConnectCommand(qid=qid, sqsize=sqsize), ConnectData(cntlid=cntlid))


def expect_invalid_param(call: object, where: IATTR, offset: int) -> None:
    with pytest.raises(ProtocolError) as info:
        call()  # type: ignore[operator]
    assert (info.value.status, info.value.dnr) == (StatusCode.CONNECT_INVALID_PARAM, True)
    assert info.value.result == connect_invalid_param_result(where, offset)


def test_admin_connect_requires_dynamic_cntlid() -> None:
    expect_invalid_param(lambda: ControllerState.admin_connect(
        ConnectCommand(qid=0, sqsize=31), ConnectData(cntlid=1), cntlid=1, max_io_queues=4),
        IATTR.DATA, 16)
    assert admin().kato == 5000 and admin().queues == frozenset({0})


@pytest.mark.parametrize("sqsize", [0, 128, 0xFFFF])
def test_sqsize_zero_or_above_mqes(sqsize: int) -> None:
    expect_invalid_param(lambda: admin(sqsize=sqsize), IATTR.SQE, 44)
    expect_invalid_param(lambda: io_connect(ready(), 1, sqsize=sqsize), IATTR.SQE, 44)


def test_io_queue_rules() -> None:
    s = ready()
    s = io_connect(s, 1)
    s = io_connect(s, 2)
    assert s.queues == frozenset({0, 1, 2})
    with pytest.raises(ProtocolError) as info:
        io_connect(s, 2)  # duplicate qid
    assert (info.value.status, info.value.dnr) == (StatusCode.CMD_SEQ_ERROR, True)
    expect_invalid_param(lambda: io_connect(s, 5), IATTR.SQE, 42)  # beyond max_io_queues 4
    expect_invalid_param(lambda: io_connect(s, 3, cntlid=2), IATTR.DATA, 16)  # unknown ctrl
    gone = s.disconnect(0)
    expect_invalid_param(lambda: io_connect(gone, 3), IATTR.DATA, 16)  # admin queue first


def test_granted_queue_count_limits_qids() -> None:
    s, granted = ready().set_number_of_queues(NumberOfQueues(nsqr=1, ncqr=1))
    assert granted == NumberOfQueues(1, 1) and int(granted) == 0x00010001
    s = io_connect(io_connect(s, 1), 2)
    expect_invalid_param(lambda: io_connect(s, 3), IATTR.SQE, 42)
    _, capped = ready().set_number_of_queues(NumberOfQueues(nsqr=63, ncqr=63))
    assert capped == NumberOfQueues(3, 3)  # max_io_queues 4, 0-based
    with pytest.raises(ProtocolError) as info:
        s.set_number_of_queues(NumberOfQueues(1, 1))  # after I/O queues exist
    assert info.value.status == StatusCode.CMD_SEQ_ERROR
    with pytest.raises(ProtocolError) as info:
        ready().set_number_of_queues(NumberOfQueues(0xFFFF, 1))
    assert info.value.status == StatusCode.INVALID_FIELD


def test_aer_limit() -> None:
    s = ready()
    for _ in range(4):  # aerl 3 is 0-based: four may be outstanding
        s = s.submit_aer()
    with pytest.raises(ProtocolError) as info:
        s.submit_aer()
    assert info.value.status == StatusCode.AER_LIMIT_EXCEEDED
    assert s.complete_aer().submit_aer().outstanding_aers == 4
