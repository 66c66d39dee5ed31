"""Persistent reservations: the state machine of one namespace's registrants and holder.

Sans-I/O: every command is a function of (state, host, fields) that returns an
:class:`Outcome` (the status, the new state, the notices to send and the hosts to fence);
nothing here touches a socket, a file or a clock.  The semantics are nvmet's
(drivers/nvme/target/pr.c, see /work/shared/spec/nvmeof-tcp-ana-resv.md section 3.7) with
three deliberate differences, all of them the NVMe base specification's:

* a host registered while the type is "all registrants" (5, 6) *is* a holder: it may
  Acquire the same type again, Release it, and Report shows it as a holder (nvmet keeps one
  holder pointer and answers a non-pointer registrant's Release with "no effect");
* Register with Replace and IEKEY from a host not registered registers it (NVMe 1.3 IEKEY
  semantics, RESCAP bit 7; nvmet answers Conflict);
* CPTPL is honoured (nvmet ignores it): 3 persists the state through a target restart,
  2 clears that; where the volume cannot keep it (a ramdisk) CPTPL 3 is Invalid Field.

Registrants are keyed by the 128-bit host identifier of the Connect data, not by
controller: every controller of one host ID is the same registrant (the host's paths).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

from blockfabric.protocol import resv
from blockfabric.protocol.resv import LogType, RType
from blockfabric.protocol.status import StatusCode

OK = StatusCode.SUCCESS
CONFLICT = StatusCode.RESERVATION_CONFLICT    # always with DNR
HOST_ID_INCONSISTENT = StatusCode.HOST_ID_INCONSISTENT
ALL_REGS = (RType.WRITE_EXCLUSIVE_ALL_REGS, RType.EXCLUSIVE_ACCESS_ALL_REGS)
REG_ONLY = (RType.WRITE_EXCLUSIVE_REG_ONLY, RType.EXCLUSIVE_ACCESS_REG_ONLY)
#: Reservation types under which a registrant may read / write as the holder does.
_REGISTRANTS_WRITE = (3, 5)
_REGISTRANTS_ACCESS = (4, 6)
MAX_REGISTRANTS = 4096          # bounds a peer-driven state (and the stored object)


@dataclass(frozen=True)
class State:
    """One namespace's reservation state; frozen: each change makes a new one."""

    gen: int = 0
    rtype: int = 0                  # 0: no reservation
    holder: bytes | None = None     # the holder's host ID (types 5/6: the first registrant)
    regs: tuple[tuple[bytes, int], ...] = ()   # (host ID, key), in registration order
    ptpl: bool = False
    version: int = 0                # bumped by every stored change (the store's CAS token)

    # -- queries ---------------------------------------------------------------------------
    def key_of(self, hostid: bytes) -> int | None:
        for h, k in self.regs:
            if h == hostid:
                return k
        return None

    def registered(self, hostid: bytes) -> bool:
        return self.key_of(hostid) is not None

    def holds(self, hostid: bytes) -> bool:
        if not self.rtype or not self.registered(hostid):
            return False
        return self.rtype in ALL_REGS or self.holder == hostid

    def conflicts(self, hostid: bytes, write: bool) -> bool:
        """Whether ``hostid`` may not issue a command of the read group (``write`` False:
        Read) or the write group (Write, Write Zeroes, DSM, Flush) now: nvmet's
        nvmet_pr_check_cmd_access."""
        rtype = self.rtype
        if not rtype or hostid == self.holder:
            return False
        if rtype == RType.WRITE_EXCLUSIVE:
            return write
        if rtype == RType.EXCLUSIVE_ACCESS:
            return True
        if rtype in _REGISTRANTS_WRITE:
            return write and not self.registered(hostid)
        return not self.registered(hostid)          # 4, 6

    # -- (de)serialization: the stored form -----------------------------------------------
    def to_json(self) -> str:
        return json.dumps({"gen": self.gen, "rtype": self.rtype,
                           "holder": self.holder.hex() if self.holder else None,
                           "regs": [[h.hex(), k] for h, k in self.regs],
                           "ptpl": self.ptpl, "version": self.version}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> State:
        """Parse a stored state; ValueError if it is not one (a torn or foreign object must
        not become a guess)."""
        try:
            d = json.loads(text)
            regs = tuple((bytes.fromhex(h), int(k)) for h, k in d["regs"])
            holder = bytes.fromhex(d["holder"]) if d["holder"] else None
            st = cls(gen=int(d["gen"]), rtype=int(d["rtype"]), holder=holder, regs=regs,
                     ptpl=bool(d["ptpl"]), version=int(d.get("version", 0)))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"not a reservation state: {exc}") from exc
        if not 0 <= st.rtype <= 6 or any(len(h) != 16 or not 0 <= k < 1 << 64
                                         for h, k in regs) \
                or len(regs) > MAX_REGISTRANTS or (st.rtype and not st.registered(holder or b"")):
            raise ValueError("not a reservation state: fields out of range")
        return st


@dataclass(frozen=True)
class Notice:
    """A notification log entry (and AEN) for every controller of ``hostid``."""

    hostid: bytes
    log_type: LogType


@dataclass
class Outcome:
    status: StatusCode
    state: State
    notices: list[Notice] = field(default_factory=list)
    #: Hosts preempted by a Preempt and Abort: their in-flight commands on the namespace
    #: must drain before the command completes.
    fenced: list[bytes] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == OK


class _Work:
    """A mutable copy of a state for one command (regs in order; holder; notices)."""

    def __init__(self, st: State) -> None:
        self.st = st
        self.regs: dict[bytes, int] = dict(st.regs)
        self.rtype = st.rtype
        self.holder = st.holder
        self.notices: list[Notice] = []
        self.fenced: list[bytes] = []

    def released(self, by: bytes) -> None:
        """"Reservation released" to every other registrant (nvmet_pr_resv_released)."""
        self.notices += [Notice(h, LogType.RESERVATION_RELEASED) for h in self.regs if h != by]

    def unregister(self, hostid: bytes) -> None:
        """nvmet_pr_unregister_one: an "all registrants" reservation passes to the first
        registrant left; another holder's leaves no reservation."""
        del self.regs[hostid]
        if hostid != self.holder:
            return
        if self.rtype in ALL_REGS:
            self.holder = next(iter(self.regs), None)
            if self.holder is None:
                self.rtype = 0
        else:
            rtype, self.holder, self.rtype = self.rtype, None, 0
            if rtype in REG_ONLY:
                self.released(hostid)

    def preempt(self, hostid: bytes, by: bytes, abort: bool) -> None:
        if abort:
            self.fenced.append(hostid)
        self.unregister(hostid)
        if hostid != by:
            self.notices.append(Notice(hostid, LogType.REGISTRATION_PREEMPTED))

    def outcome(self, status: StatusCode = OK, gen: bool = False, ptpl: bool | None = None
                ) -> Outcome:
        if status != OK:
            return Outcome(status, self.st)
        st = replace(self.st, regs=tuple(self.regs.items()), rtype=self.rtype,
                     holder=self.holder if self.rtype else None,
                     gen=(self.st.gen + 1) & 0xFFFFFFFF if gen else self.st.gen,
                     ptpl=self.st.ptpl if ptpl is None else ptpl)
        return Outcome(OK, st, self.notices, self.fenced)


def _fail(st: State, status: StatusCode) -> Outcome:
    return Outcome(status, st)


def register(st: State, hostid: bytes, action: int, iekey: bool, cptpl: int, crkey: int,
             nrkey: int, *, ptpl_capable: bool) -> Outcome:
    """Reservation Register (0x0D)."""
    if cptpl == resv.Cptpl.RESERVED or (cptpl == resv.Cptpl.PERSIST and not ptpl_capable):
        return _fail(st, StatusCode.INVALID_FIELD)
    choices: dict[int, bool] = {resv.Cptpl.CLEAR: False, resv.Cptpl.PERSIST: True}
    ptpl = choices.get(cptpl)
    w = _Work(st)
    key = w.regs.get(hostid)
    if action == resv.RegisterAction.REGISTER:
        if key is not None:
            return w.outcome(OK if key == nrkey else CONFLICT, gen=True, ptpl=ptpl)
        if len(w.regs) >= MAX_REGISTRANTS:
            return _fail(st, StatusCode.CAPACITY_EXCEEDED)
        w.regs[hostid] = nrkey
        return w.outcome(gen=True, ptpl=ptpl)
    if action == resv.RegisterAction.UNREGISTER:
        if key is None or not (iekey or key == crkey):
            return _fail(st, CONFLICT)
        w.unregister(hostid)
        return w.outcome(gen=True, ptpl=ptpl)
    if action == resv.RegisterAction.REPLACE:
        if key is None:
            if not iekey:
                return _fail(st, CONFLICT)
            if nrkey == 0:
                return _fail(st, StatusCode.INVALID_FIELD)
            if len(w.regs) >= MAX_REGISTRANTS:
                return _fail(st, StatusCode.CAPACITY_EXCEEDED)
        elif not (iekey or key == crkey):
            return _fail(st, CONFLICT)
        w.regs[hostid] = nrkey          # the holder keeps its place and its reservation
        return w.outcome(gen=True, ptpl=ptpl)
    return _fail(st, StatusCode.INVALID_OPCODE)


def acquire(st: State, hostid: bytes, action: int, iekey: bool, rtype: int, crkey: int,
            prkey: int) -> Outcome:
    """Reservation Acquire (0x11)."""
    if iekey or not 1 <= rtype <= 6:
        return _fail(st, StatusCode.INVALID_FIELD)
    if st.key_of(hostid) != crkey:
        return _fail(st, CONFLICT)
    w = _Work(st)
    if action == resv.AcquireAction.ACQUIRE:
        if not st.rtype:
            w.holder, w.rtype = hostid, rtype
            return w.outcome()
        return w.outcome(OK if st.holds(hostid) and st.rtype == rtype else CONFLICT)
    if action not in (resv.AcquireAction.PREEMPT, resv.AcquireAction.PREEMPT_AND_ABORT):
        return _fail(st, StatusCode.INVALID_OPCODE)
    abort = action == resv.AcquireAction.PREEMPT_AND_ABORT

    def by_key(others_only: bool) -> bool:
        hit = False
        for h, k in list(w.regs.items()):
            if k == prkey and not (others_only and h == hostid):
                hit = True
                w.preempt(h, hostid, abort)
        return hit

    if not st.rtype:                                        # no holder
        return w.outcome(OK if by_key(False) else CONFLICT, gen=True)
    if st.rtype in ALL_REGS:
        if prkey == 0:
            w.holder, w.rtype = hostid, rtype
            for h in [h for h in w.regs if h != hostid]:
                w.preempt(h, hostid, abort)
            return w.outcome(gen=True)
        return w.outcome(OK if by_key(False) else CONFLICT, gen=True)
    if st.holder == hostid:                                 # the holder changes its type
        w.rtype = rtype
        if rtype != st.rtype:
            w.released(hostid)
        return w.outcome(gen=True)
    holder_key = st.key_of(st.holder) if st.holder else None
    if prkey == holder_key:
        w.holder, w.rtype = hostid, rtype
        by_key(True)
        if rtype != st.rtype:
            w.released(hostid)
        return w.outcome(gen=True)
    if prkey:
        return w.outcome(OK if by_key(False) else CONFLICT, gen=True)
    return _fail(st, StatusCode.INVALID_FIELD)


def release(st: State, hostid: bytes, action: int, iekey: bool, rtype: int,
            crkey: int) -> Outcome:
    """Reservation Release (0x15)."""
    if iekey:
        return _fail(st, StatusCode.INVALID_FIELD)
    if st.key_of(hostid) != crkey:
        return _fail(st, CONFLICT)
    w = _Work(st)
    if action == resv.ReleaseAction.RELEASE:
        if not st.holds(hostid):
            return w.outcome()                  # nothing held: success, no effect
        if st.rtype != rtype:
            return _fail(st, CONFLICT)
        w.holder, w.rtype = None, 0
        if rtype not in (RType.WRITE_EXCLUSIVE, RType.EXCLUSIVE_ACCESS):
            w.released(hostid)
        return w.outcome()
    if action == resv.ReleaseAction.CLEAR:
        w.notices = [Notice(h, LogType.RESERVATION_PREEMPTED) for h in w.regs if h != hostid]
        w.regs.clear()
        w.holder, w.rtype = None, 0
        return w.outcome(gen=True)
    return _fail(st, StatusCode.INVALID_OPCODE)


def set_ptpl(st: State, ptpl: bool) -> State:
    return replace(st, ptpl=ptpl)


def report(st: State) -> resv.ReservationStatus:
    """The Reservation Status data structure (cntlid 0xFFFF: dynamic controllers, as nvmet)."""
    regs = tuple(resv.Registrant(0xFFFF, st.holds(h), h, k) for h, k in st.regs)
    return resv.ReservationStatus(st.gen, st.rtype, len(regs), st.ptpl, regs)


def describe(st: State) -> dict[str, Any]:
    """For the status snapshot and logs."""
    return {"gen": st.gen, "rtype": resv.RTYPE_NAMES.get(st.rtype, str(st.rtype)),
            "holder": st.holder.hex() if st.holder else None, "ptpl": st.ptpl,
            "registrants": {h.hex(): k for h, k in st.regs}}
