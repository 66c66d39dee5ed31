"""The controller state machine, as data (in the style of h11's ``_state.py``).

Two tables decide everything: :data:`CC_TRANSITIONS` (what a write to CC does to the
controller's phase, and so to CSTS) and :data:`COMMAND_RULES` (which commands a queue may
run in which state).  :class:`ControllerState` is immutable: each method takes the event's
values and returns the new state (or the answer), or raises :class:`ProtocolError` carrying
the status to complete the command with.  The rules follow Linux nvmet (fabrics-cmd.c,
core.c nvmet_update_cc / nvmet_check_ctrl_status) and spec sheet sections 5 and 9.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from blockfabric.protocol.admin import NumberOfQueues
from blockfabric.protocol.capsule import SQE
from blockfabric.protocol.errors import ProtocolError
from blockfabric.protocol.fabrics import (CAP, CC, CC_IOCQES, CC_IOSQES, CSTS, DYNAMIC_CNTLID,
                                          IATTR, IPO_DATA_CNTLID, IPO_SQE_QID, IPO_SQE_SQSIZE,
                                          VS, ConnectCommand, ConnectData, Property,
                                          PropertyGet, PropertySet, ShutdownStatus,
                                          connect_invalid_param)
from blockfabric.protocol.opcodes import FABRICS_OPCODE, FabricsType
from blockfabric.protocol.status import StatusCode


class Phase(enum.Enum):
    """Where the controller is in its enable/shutdown life (CSTS follows from it)."""

    DISABLED = "disabled"  # CC.EN=0: only Property Get/Set work on the admin queue
    READY = "ready"  # CC.EN=1, CSTS.RDY=1: commands run
    FAILED = "failed"  # enabled with a configuration we cannot honour: CSTS.CFS=1
    SHUTTING_DOWN = "shutting down"  # CC.SHN set, CSTS.SHST=01 until the target drains
    SHUT_DOWN = "shut down"  # CSTS.SHST=10
    HALTED = "halted"  # CC.SHN cleared again with EN still 1: needs a reset (EN 1->0)


class CCEvent(enum.Enum):
    """What a CC write changed, in the order nvmet_update_cc applies them."""

    ENABLE = "EN 0->1"
    ENABLE_INVALID = "EN 0->1 with unsupported CSS/MPS/AMS/IOSQES/IOCQES"
    DISABLE = "EN 1->0"
    SHUTDOWN = "SHN 0->normal/abrupt"
    SHUTDOWN_DONE = "the target finished draining"
    SHUTDOWN_CLEAR = "SHN ->0"


# (phase, event) -> new phase.  A pair that is absent leaves the phase as it is.
CC_TRANSITIONS: dict[tuple[Phase, CCEvent], Phase] = {
    (Phase.DISABLED, CCEvent.ENABLE): Phase.READY,
    (Phase.DISABLED, CCEvent.ENABLE_INVALID): Phase.FAILED,
    (Phase.DISABLED, CCEvent.SHUTDOWN): Phase.SHUT_DOWN,  # nothing to drain
    (Phase.READY, CCEvent.DISABLE): Phase.DISABLED,
    (Phase.READY, CCEvent.SHUTDOWN): Phase.SHUTTING_DOWN,
    (Phase.FAILED, CCEvent.DISABLE): Phase.DISABLED,
    (Phase.FAILED, CCEvent.SHUTDOWN): Phase.SHUT_DOWN,
    (Phase.SHUTTING_DOWN, CCEvent.SHUTDOWN_DONE): Phase.SHUT_DOWN,
    (Phase.SHUTTING_DOWN, CCEvent.DISABLE): Phase.DISABLED,
    (Phase.SHUTTING_DOWN, CCEvent.SHUTDOWN_CLEAR): Phase.HALTED,
    (Phase.SHUT_DOWN, CCEvent.DISABLE): Phase.DISABLED,
    (Phase.SHUT_DOWN, CCEvent.SHUTDOWN_CLEAR): Phase.HALTED,
    (Phase.HALTED, CCEvent.DISABLE): Phase.DISABLED,
    (Phase.HALTED, CCEvent.SHUTDOWN): Phase.SHUT_DOWN,
}

# phase -> CSTS
PHASE_CSTS: dict[Phase, CSTS] = {
    Phase.DISABLED: CSTS(),
    Phase.READY: CSTS(rdy=True),
    Phase.FAILED: CSTS(cfs=True),
    Phase.SHUTTING_DOWN: CSTS(shst=ShutdownStatus.IN_PROGRESS),
    Phase.SHUT_DOWN: CSTS(shst=ShutdownStatus.COMPLETE),
    Phase.HALTED: CSTS(),
}


class QueueState(enum.Enum):
    """A transport queue, as the command rules see it."""

    UNCONNECTED = "unconnected"
    ADMIN = "admin"
    IO = "io"


class CommandClass(enum.Enum):
    """Commands grouped the way the rules treat them."""

    CONNECT = "connect"
    PROPERTY = "property get/set"
    AUTH = "authentication send/receive"
    FABRICS_OTHER = "other fabrics command"
    NVME = "admin or I/O command"


READY_REQUIRED = "ready"  # rule value: allowed once CC.EN=1 and CSTS.RDY=1

# (queue, command class) -> None (allowed), READY_REQUIRED, or the status (| DNR) to answer.
COMMAND_RULES: dict[tuple[QueueState, CommandClass], StatusCode | str | None] = {
    (QueueState.UNCONNECTED, CommandClass.CONNECT): None,
    (QueueState.UNCONNECTED, CommandClass.PROPERTY): StatusCode.INVALID_OPCODE,
    (QueueState.UNCONNECTED, CommandClass.AUTH): StatusCode.INVALID_OPCODE,
    (QueueState.UNCONNECTED, CommandClass.FABRICS_OTHER): StatusCode.INVALID_OPCODE,
    (QueueState.UNCONNECTED, CommandClass.NVME): StatusCode.INVALID_OPCODE,
    (QueueState.ADMIN, CommandClass.CONNECT): StatusCode.INVALID_OPCODE,
    (QueueState.ADMIN, CommandClass.PROPERTY): None,
    (QueueState.ADMIN, CommandClass.AUTH): None,
    (QueueState.ADMIN, CommandClass.FABRICS_OTHER): StatusCode.INVALID_OPCODE,
    (QueueState.ADMIN, CommandClass.NVME): READY_REQUIRED,
    (QueueState.IO, CommandClass.CONNECT): StatusCode.INVALID_OPCODE,
    (QueueState.IO, CommandClass.PROPERTY): StatusCode.INVALID_OPCODE,
    (QueueState.IO, CommandClass.AUTH): None,
    (QueueState.IO, CommandClass.FABRICS_OTHER): StatusCode.INVALID_OPCODE,
    (QueueState.IO, CommandClass.NVME): READY_REQUIRED,
}

_FABRICS_CLASSES = {
    int(FabricsType.CONNECT): CommandClass.CONNECT,
    int(FabricsType.PROPERTY_GET): CommandClass.PROPERTY,
    int(FabricsType.PROPERTY_SET): CommandClass.PROPERTY,
    int(FabricsType.AUTH_SEND): CommandClass.AUTH,
    int(FabricsType.AUTH_RECEIVE): CommandClass.AUTH,
}


def command_class(sqe: SQE) -> CommandClass:
    """Which rule row ``sqe`` falls under."""
    if sqe.opcode != FABRICS_OPCODE:
        return CommandClass.NVME
    return _FABRICS_CLASSES.get(sqe.fctype, CommandClass.FABRICS_OTHER)


def admit(sqe: SQE, queue: QueueState, ctrl: ControllerState | None = None) -> None:
    """Raise the answer if ``sqe`` may not run on a queue in state ``queue`` now."""
    rule = COMMAND_RULES[queue, command_class(sqe)]
    if rule is None:
        return
    if rule == READY_REQUIRED:
        if ctrl is not None and ctrl.ready:
            return
        raise ProtocolError(f"opcode {sqe.opcode:#x} before CC.EN=1 and CSTS.RDY=1",
                            StatusCode.CMD_SEQ_ERROR, cid=sqe.cid)
    raise ProtocolError(f"opcode {sqe.opcode:#x}/fctype {sqe.fctype:#x} on a {queue.value} "
                        "queue", rule, cid=sqe.cid)  # type: ignore[arg-type]


# CC values nvmet can run: NVM (0) or 'all I/O command sets' (6, Linux sends it when
# CAP.CSS has bit 6), 4 KiB pages, round robin, 64/16-byte entries.
CC_CSS_NVM = 0
CC_CSS_CSI = 6
CAP_CSS_CSI = 1 << 6


def cc_supported(cc: CC, cap: CAP) -> bool:
    """Whether enabling with ``cc`` gives a working controller (else CSTS.CFS)."""
    css_ok = cc.css == CC_CSS_NVM or (cc.css == CC_CSS_CSI and cap.css & CAP_CSS_CSI)
    return bool(css_ok and cc.mps == 0 and cc.ams == 0 and cc.iosqes == CC_IOSQES
                and cc.iocqes == CC_IOCQES)


def cc_events(old: CC, new: CC, cap: CAP) -> list[CCEvent]:
    """The events a CC write causes, in nvmet_update_cc's order."""
    events = []
    if new.en and not old.en:
        events.append(CCEvent.ENABLE if cc_supported(new, cap) else CCEvent.ENABLE_INVALID)
    if old.en and not new.en:
        events.append(CCEvent.DISABLE)
    if new.shn and not old.shn:
        events.append(CCEvent.SHUTDOWN)
    if old.shn and not new.shn:
        events.append(CCEvent.SHUTDOWN_CLEAR)
    return events


DEFAULT_CAP = CAP(mqes=127, to=15, css=1 | CAP_CSS_CSI)
DEFAULT_VS = VS(mjr=1, mnr=3)
ADMIN_QID = 0
QUEUE_COUNT_UNLIMITED = 0xFFFF  # Set Features Number of Queues: 0xFFFF is invalid


@dataclass(frozen=True, slots=True)
class ControllerState:
    """One controller: registers, connected queues and granted queue count."""

    cntlid: int
    max_io_queues: int  # the subsystem's limit (nvmet: max_qid)
    cap: CAP = DEFAULT_CAP
    vs: VS = DEFAULT_VS
    cc: CC = CC()
    phase: Phase = Phase.DISABLED
    queues: frozenset[int] = frozenset({ADMIN_QID})  # connected qids; admin comes first
    granted_io_queues: int | None = None  # from Set Features Number of Queues (1-based)
    kato: int = 0  # ms, from the admin Connect
    aerl: int = 3  # 0-based limit on outstanding AERs (Identify Controller aerl)
    outstanding_aers: int = 0

    # ----------------------------------------------------------------- registers

    @property
    def csts(self) -> CSTS:
        return PHASE_CSTS[self.phase]

    @property
    def ready(self) -> bool:
        return self.phase is Phase.READY

    def set_cc(self, value: int) -> ControllerState:
        """The host wrote CC: apply the transition table."""
        new = CC.from_int(value)
        phase = self.phase
        for event in cc_events(self.cc, new, self.cap):
            phase = CC_TRANSITIONS.get((phase, event), phase)
        return dataclasses.replace(self, cc=new, phase=phase)

    def shutdown_complete(self) -> ControllerState:
        """The target finished draining after CC.SHN: CSTS.SHST becomes 'complete'."""
        phase = CC_TRANSITIONS.get((self.phase, CCEvent.SHUTDOWN_DONE), self.phase)
        return dataclasses.replace(self, phase=phase)

    def property_get(self, cmd: PropertyGet) -> int:
        """The CQE result for a Property Get (CAP is the only 8-byte register)."""
        registers = _PROPERTIES_8 if cmd.size == 8 else _PROPERTIES_4
        name = registers.get(cmd.offset)
        if name is None:
            raise ProtocolError(f"no {cmd.size}-byte property at {cmd.offset:#x}",
                                StatusCode.INVALID_FIELD)
        return int(getattr(self, name).to_int())

    def property_set(self, cmd: PropertySet) -> ControllerState:
        """Only CC is writable, with a 4-byte access (as nvmet)."""
        if cmd.size != 4 or cmd.offset != Property.CC:
            raise ProtocolError(f"property set {cmd.size} bytes at {cmd.offset:#x}",
                                StatusCode.INVALID_FIELD)
        return self.set_cc(cmd.value & 0xFFFFFFFF)

    # ----------------------------------------------------------------- queues

    @classmethod
    def admin_connect(cls, cmd: ConnectCommand, data: ConnectData, *, cntlid: int,
                      max_io_queues: int, cap: CAP = DEFAULT_CAP, vs: VS = DEFAULT_VS,
                      aerl: int = 3) -> ControllerState:
        """A Connect on qid 0 makes a new controller numbered ``cntlid``."""
        if cmd.qid != ADMIN_QID:
            raise ValueError("admin_connect is for qid 0; use io_connect")
        if data.cntlid != DYNAMIC_CNTLID:
            raise connect_invalid_param(f"admin connect names cntlid {data.cntlid:#x}",
                                        IATTR.DATA, IPO_DATA_CNTLID)
        _check_sqsize(cmd, cap)
        return cls(cntlid=cntlid, max_io_queues=max_io_queues, cap=cap, vs=vs,
                   kato=cmd.kato, aerl=aerl)

    def io_connect(self, cmd: ConnectCommand, data: ConnectData) -> ControllerState:
        """A Connect for I/O queue ``cmd.qid`` of this controller."""
        if data.cntlid != self.cntlid or ADMIN_QID not in self.queues:
            raise connect_invalid_param(f"no controller {data.cntlid:#x}", IATTR.DATA,
                                        IPO_DATA_CNTLID)
        limit = self.max_io_queues
        if self.granted_io_queues is not None:
            limit = min(limit, self.granted_io_queues)
        if not 0 < cmd.qid <= limit:
            raise connect_invalid_param(f"qid {cmd.qid} outside 1..{limit}", IATTR.SQE,
                                        IPO_SQE_QID)
        if cmd.qid in self.queues:
            raise ProtocolError(f"qid {cmd.qid} is already connected", StatusCode.CMD_SEQ_ERROR)
        _check_sqsize(cmd, self.cap)
        return dataclasses.replace(self, queues=self.queues | {cmd.qid})

    def disconnect(self, qid: int) -> ControllerState:
        """Queue ``qid`` went away (the admin queue's loss ends the controller)."""
        return dataclasses.replace(self, queues=self.queues - {qid})

    def set_number_of_queues(self, requested: NumberOfQueues
                             ) -> tuple[ControllerState, NumberOfQueues]:
        """Set Features FID 0x07: grant at most the subsystem's limit (0-based counts)."""
        if QUEUE_COUNT_UNLIMITED in (requested.nsqr, requested.ncqr):
            raise ProtocolError("number of queues 0xFFFF", StatusCode.INVALID_FIELD)
        if len(self.queues - {ADMIN_QID}):
            raise ProtocolError("number of queues changed after I/O queues were created",
                                StatusCode.CMD_SEQ_ERROR)
        top = self.max_io_queues - 1
        granted = NumberOfQueues(min(requested.nsqr, top), min(requested.ncqr, top))
        state = dataclasses.replace(self, granted_io_queues=min(granted.nsqr, granted.ncqr) + 1)
        return state, granted

    # ----------------------------------------------------------------- commands

    def admit(self, sqe: SQE, qid: int) -> None:
        """Raise the answer if ``sqe`` may not run on connected queue ``qid`` now."""
        admit(sqe, QueueState.ADMIN if qid == ADMIN_QID else QueueState.IO, self)

    def submit_aer(self) -> ControllerState:
        """An Asynchronous Event Request arrived; more than aerl+1 outstanding -> 0x105."""
        if self.outstanding_aers > self.aerl:
            raise ProtocolError("too many outstanding AERs", StatusCode.AER_LIMIT_EXCEEDED)
        return dataclasses.replace(self, outstanding_aers=self.outstanding_aers + 1)

    def complete_aer(self) -> ControllerState:
        """One outstanding AER was completed (an event, or the controller going away)."""
        return dataclasses.replace(self, outstanding_aers=max(0, self.outstanding_aers - 1))


_PROPERTIES_8 = {int(Property.CAP): "cap"}
_PROPERTIES_4 = {int(Property.VS): "vs", int(Property.CC): "cc", int(Property.CSTS): "csts"}


def _check_sqsize(cmd: ConnectCommand, cap: CAP) -> None:
    if not 0 < cmd.sqsize <= cap.mqes:
        raise connect_invalid_param(f"sqsize {cmd.sqsize} outside 1..{cap.mqes}", IATTR.SQE,
                                    IPO_SQE_SQSIZE)
