"""The host's end of an NVMe/TCP queue: the RDMA host queue's command slots, moved by PDUs.

Everything about command slots (cids with generations, submission from any thread, the
stale-response checks, failing every outstanding command once) is
:class:`~blockfabric.fabric.host_side.HostQueue`'s.  Only the transport differs: a command
whose data the caller named by a keyed SGL into memory registered with the controller's
protection domain goes out with an NVMe/TCP transport SGL (0x5A) instead, and its data
moves as H2CData answering the controller's R2Ts (writes) or arrives as C2HData (reads),
each checked against the command it names (cid, direction, offset in order, length within
the command's; SUCCESS only with LAST), as the Linux host checks them.  In-capsule data goes
in the CapsuleCmd, with an in-capsule SGL (0x01, offset 0).

**Writes that fit the capsule go in it, always** (as the Linux host sends them): a Fabrics
command's data up to 8 KiB (NVME_TCP_ADMIN_CCSZ, so Connect carries its 1024 bytes), other
admin commands' up to 8 KiB less the SQE, I/O commands' up to IOCCSZ less the SQE.  Linux
nvmet-tcp depends on it: for a write of at most its port's inline_data_size (16 KiB by
default) it waits for in-capsule data and drops the R2T it would send (its
``nvmet_tcp_queue_response`` returns early while the command is the one being received), so
a Connect sent with a transport SGL and an R2T expected got no R2T, no answer, and the
queue's next command ("out of commands") made it close the connection.  A data digest that
does not match fails that command (Data Transfer Error) and the queue goes on; a termination
request or any other violation ends the queue.

:func:`open_connection` makes the TCP connection and runs ICReq/ICResp before the queue
exists, blocking, within the connect timeout.
"""

from __future__ import annotations

import logging
import socket
import struct
import time
from threading import get_ident as _get_ident
from typing import TYPE_CHECKING, Any

from blockfabric.errors import QueueDead
from blockfabric.fabric.host_side import (GEN_MASK, SLOT_BITS, SPLIT_MIN, HostQueue, Slot,
                                         inline_mismatch)
from blockfabric.fabric.tcp import Buf, PduConnection, resolve
from blockfabric.protocol import SQE_SIZE, StatusCode
from blockfabric.protocol import tcp_pdu
from blockfabric.protocol.capsule import PSDT_SGL
from blockfabric.protocol.rw import TCP_CAPSULE_RW
from blockfabric.protocol.sgl import TYPE_KEYED
from blockfabric.rdma import SGE, SendFlags, SendWR, WrOpcode

if TYPE_CHECKING:
    from blockfabric.fabric.reactor import Reactor
    from blockfabric.fabric.tcp import _LocalKeys
    from blockfabric.rdma.soft.memory import SoftPD

log = logging.getLogger(__name__)

_SGL_WORDS = struct.Struct("<QQ")
_CQE_RAW = struct.Struct("<QHHHH")
_pack_capsule_rw = TCP_CAPSULE_RW.pack_into
_unpack_data_fields = tcp_pdu.DATA_FIELDS.unpack_from
_CAPSULE_CMD = tcp_pdu.CAPSULE_CMD
_F_SUCCESS, _F_LAST = tcp_pdu.F_DATA_SUCCESS, tcp_pdu.F_DATA_LAST
_C2H_DATA, _R2T = tcp_pdu.C2H_DATA, tcp_pdu.R2T
_TRANSPORT_WORD = tcp_pdu.SGL_TRANSPORT << 56
_INCAPSULE_WORD = tcp_pdu.SGL_INCAPSULE << 56
#: the largest data PDU a host takes (its commands are at most 8 MiB: Controller.max_transfer)
MAX_DATA = 8 << 20
#: MAXR2T asked for in ICReq (0's based): R2Ts a controller may have outstanding per
#: command, so that a write larger than its MAXH2CDATA is not one round trip per piece
MAXR2T = 7
#: the status word (CQE byte 14) of Data Transfer Error, for a data digest mismatch
_DATA_TRANSFER_ERROR = StatusCode.DATA_TRANSFER_ERROR << 1
_NO_MARK = 1 << 62              # a slot's data mark while its send() is under way


def open_connection(address: str, port: int, *, hdgst: bool, ddgst: bool,
                    timeout: float, hpda: int = 0) -> tuple[socket.socket, tcp_pdu.ICResp]:
    """Connect and initialise (ICReq asking ``hpda``, then the ICResp checked as the
    Linux host checks it, but any CPDA up to 31 taken); raises ConnectionError (refused, a
    bad ICResp, a termination request) or TimeoutError."""
    deadline = time.monotonic() + timeout
    try:
        sock = socket.create_connection((address, port), timeout=timeout)
    except ConnectionRefusedError as exc:
        raise ConnectionRefusedError(f"connection to {address}:{port} refused: is an NVMe/TCP "
                                     "listener there?") from exc
    except socket.timeout:
        raise TimeoutError(f"no NVMe/TCP connection to {address}:{port} within {timeout:g} s"
                           ) from None
    try:
        request = tcp_pdu.ICReq(hdgst=hdgst, ddgst=ddgst, maxr2t=MAXR2T, hpda=hpda)
        sock.sendall(request.pack())
        buf = bytearray()
        while len(buf) < tcp_pdu.IC_SIZE:
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                chunk = sock.recv(tcp_pdu.IC_SIZE - len(buf))
            except socket.timeout:
                raise TimeoutError(f"{address}:{port}: no ICResp within {timeout:g} s") from None
            if not chunk:
                raise ConnectionError(f"{address}:{port} closed the connection at ICReq")
            buf += chunk
            if len(buf) >= tcp_pdu.COMMON_SIZE and buf[0] == tcp_pdu.C2H_TERM:
                raise ConnectionError(f"{address}:{port} refused the ICReq (termination "
                                      "request)")
        try:
            tcp_pdu.check_header(*tcp_pdu.header(buf), to_controller=False, initialized=False,
                            limits=tcp_pdu.Limits())
            if buf[0] != tcp_pdu.ICRESP:
                raise tcp_pdu.PduError("not an ICResp", tcp_pdu.Fes.SEQUENCE_ERROR)
            resp = tcp_pdu.ICResp.unpack(buf, request)
        except tcp_pdu.PduError as exc:
            raise ConnectionError(f"{address}:{port}: bad ICResp: {exc}") from exc
    except BaseException:
        sock.close()
        raise
    return sock, resp


class TcpHostQueue(PduConnection, HostQueue):
    """One host queue over NVMe/TCP (see the module text)."""

    term_type = tcp_pdu.H2C_TERM
    to_controller = False
    #: what a host queues stays valid until the controller has read it: fresh headers, and
    #: a command's data, which its owner keeps until the command completes (which takes
    #: the controller's answer, normally after the data was read): no copy of a 1 MiB
    #: write's H2CData when the socket is full.  An answer that comes before its data was
    #: written copies what is left first (``_marks``, :meth:`detach_unsent`).
    copy_unsent = False
    pd: SoftPD[_LocalKeys]          # (local memory only: blockfabric.fabric.tcp.local_pd)

    def __init__(self, sock: socket.socket, pd: SoftPD[_LocalKeys], resp: tcp_pdu.ICResp, *,
                 qid: int, depth: int, inline_size: int, name: str, hpda: int = 0) -> None:
        PduConnection.__init__(self, sock, name)
        self.pd = pd
        self.qid = qid
        self.depth = depth
        self.inline_size = inline_size
        #: the most in-capsule data a write of this queue carries (what the Linux host
        #: sends): IOCCSZ less the SQE on an I/O queue, NVME_TCP_ADMIN_CCSZ less the SQE on
        #: the admin queue, NVME_TCP_ADMIN_CCSZ for a Fabrics command on any queue
        self.capsule_data = inline_size if qid else tcp_pdu.ADMIN_CCSZ - SQE_SIZE
        self.maxh2cdata = resp.maxh2cdata
        self.negotiated(resp.hdgst, resp.ddgst, 0, MAX_DATA, hpda, resp.cpda)
        self._init_slots([Slot(i, memoryview(bytearray(SQE_SIZE + inline_size)),
                               SendWR(i, WrOpcode.SEND, [SGE(0, SQE_SIZE, 0)],
                                      SendFlags.SIGNALED))
                          for i in range(depth)])
        #: per slot, the data the transport moves: [view, length, moved, to host, bad]
        self._data: list[list[Any] | None] = [None] * depth
        #: per slot, where the last of the data it queued by reference (in-capsule data,
        #: H2CData: views of its owner's memory) ends in the stream: an answer that comes
        #: before that is written has the rest copied (the owner reuses the memory)
        self._marks = [0] * depth
        #: the C2HData precheck passed last: (cccid, its slot's data, the end it reaches)
        self._checked: tuple[int, Any, int] = (0, None, 0)
        self._half = -1
        self._answered = 0

    def attach(self, reactor: Reactor) -> None:
        PduConnection.attach(self, reactor)
        self._note_loop(reactor)

    # -- sending commands -----------------------------------------------------------------
    def submit_rw(self, owner: Any, opcode: int, nsid: int, slba: int, nlb: int, addr: int,
                  length: int, rkey: int, data: Any = None) -> int:
        """:meth:`HostQueue.submit_rw` without the RDMA queue's reactor fast path, which
        posts the slot's SEND work request itself: here every command goes out through
        :meth:`_post` (the CapsuleCmd PDU, and the data's transport SGL)."""
        if data is not None and length <= self.inline_size and len(data) != length:
            raise ValueError(inline_mismatch(data, length))    # (before a slot is taken)
        free = self._free
        if free and _get_ident() == self._loop_ident and self.dead_reason is None:
            # the reactor's own submission (the mount's): no lock, no closure; _take inline
            slot = self.slots[free.pop()]
            gen = (slot.gen + 1) & GEN_MASK
            slot.gen = gen
            slot.cid = gen << SLOT_BITS | slot.index
            slot.owner = owner
            slot.sent = False
            slot.raw = None
            slot.busy = True
            return self._post_rw(slot, opcode, nsid, slba, nlb, addr, length, rkey, data,
                                 False)
        return self._submit_with(owner, lambda slot, locked: self._post_rw(
            slot, opcode, nsid, slba, nlb, addr, length, rkey, data, locked), None)

    def _post_rw(self, slot: Slot, opcode: int, nsid: int, slba: int, nlb: int, addr: int,
                 length: int, rkey: int, data: Any, locked: bool) -> int:
        """The data path's Read or Write as one CapsuleCmd PDU packed in one go (the
        reactor's own submission, no digests, data right after the header): what
        HostQueue._post_rw and :meth:`_post` do, without the SQE packed into the slot and
        read back, or the header built apart.  Anything else, or memory that is not all in
        one region of the queue's PD, goes their way (which refuses it, saying why)."""
        if locked or self.hdgst or self.ddgst or self.tx_align != 4 or length <= 0 \
                or self.closed:
            return HostQueue._post_rw(self, slot, opcode, nsid, slba, nlb, addr, length, rkey,
                                      data, locked)
        index = slot.index
        write = opcode & 3 == 1
        # data given that fits goes in the capsule as it is (submit_rw made sure that it is
        # ``length`` bytes); otherwise the memory at ``addr``:
        if data is None or length > self.inline_size:
            pd = self.pd
            keys = pd.ctx
            mr = keys.lkeys.get(rkey) or keys.rkeys.get(rkey)
            start = addr - mr.addr if mr is not None else -1
            if mr is None or mr.pd is not pd or mr.closed or start < 0 \
                    or start + length > mr.length:
                return HostQueue._post_rw(self, slot, opcode, nsid, slba, nlb, addr, length,
                                          rkey, data, locked)
            if write and length <= self.capsule_data:
                data = mr.buf[start:start + length]
            else:
                data = None
                self._data[index] = [mr.buf[start:start + length], length, 0, not write, False]
        pdu = bytearray(72)
        stats = self.stats                  # _count, inline
        slot.seq = stats.submitted_loop + stats.submitted_other
        stats.submitted_loop += 1
        inflight = self.depth - len(self._free)
        if inflight > stats.max_inflight:
            stats.max_inflight = inflight
        slot.sent = True
        if data is None:        # the data moves in C2HData or H2CData PDUs
            _pack_capsule_rw(pdu, 0, _CAPSULE_CMD, 0, 72, 0, 72, opcode, PSDT_SGL, slot.cid,
                             nsid, 0, 0, 0, length | _TRANSPORT_WORD, slba, nlb, 0, 0, 0)
            self._marks[index] = 0
            self.send((pdu,))
        else:                   # in the capsule, by reference (see _marks)
            self._data[index] = None
            _pack_capsule_rw(pdu, 0, _CAPSULE_CMD, 0, 72, 72, 72 + length, opcode, PSDT_SGL,
                             slot.cid, nsid, 0, 0, 0, length | _INCAPSULE_WORD, slba, nlb, 0,
                             0, 0)
            self._marks[index] = _NO_MARK
            self._marks[index] = self.send((pdu, data))
        return slot.cid

    def expecting(self) -> bool:
        """I/O commands in flight: their answers are due (the reactor spins for them).  Not
        the admin queue's: its Asynchronous Event Requests are in flight for good, and
        would keep every wait of the loop spinning."""
        return bool(self.qid) and len(self._free) < self.depth

    def in_flight(self) -> int:
        """I/O commands whose answers are due (the reactor's spin follows it); the admin
        queue counts none: its Asynchronous Event Requests wait there for good."""
        return self.depth - len(self._free) if self.qid else 0

    def _post(self, slot: Slot, length: int, locked: bool) -> int:
        view = slot.view
        addr, word = _SGL_WORDS.unpack_from(view, 24)
        kind = word >> 56
        data_len = 0
        index = slot.index
        self._data[index] = None
        data: Buf = b""                 # (set whenever data_len is)
        if kind == TYPE_KEYED:
            n = word & 0xFFFFFF
            sgl_word = n | _TRANSPORT_WORD
            if n:
                try:
                    mem = resolve(self.pd, addr, n, (word >> 24) & 0xFFFFFFFF)
                except ValueError as exc:
                    self._free_slot(slot, locked)
                    raise ValueError(f"{self.name}: the command's data: {exc}") from None
                # the data's direction: opcode bits 1:0 (fctype for a Fabrics command)
                fabrics = view[0] == 0x7F
                op = view[4] if fabrics else view[0]
                if op & 3 == 1 and n <= (tcp_pdu.ADMIN_CCSZ if fabrics else self.capsule_data):
                    data, data_len = mem, n     # a write that fits: in the capsule
                    sgl_word = n | _INCAPSULE_WORD
                else:
                    self._data[index] = [mem, n, 0, op & 3 == 2, False]
            _SGL_WORDS.pack_into(view, 24, 0, sgl_word)
        elif length > SQE_SIZE:
            data_len = length - SQE_SIZE
            data = bytes(view[SQE_SIZE:length])
        out: list[Buf] = [tcp_pdu.capsule_cmd_header(view[:SQE_SIZE], data_len, self.hdgst,
                                                     self.ddgst, self.tx_align)]
        if data_len:
            out.append(data)
            if self.ddgst:
                out.append(tcp_pdu.pack_digest(tcp_pdu.digest(data)))
        self._count(slot, locked)
        slot.sent = True
        if self.closed:
            self._free_slot(slot, locked)
            raise ConnectionError(self.dead_reason or f"{self.name}: closed")
        if kind != TYPE_KEYED or not data_len:
            self._marks[index] = 0
            if locked:
                self.send_now(out)
            else:
                self.send(out)
        else:       # (until its mark is known, an answer copies whatever is unsent)
            self._marks[index] = _NO_MARK
            self._marks[index] = self.send_now(out) if locked else self.send(out)
        return slot.cid

    # -- PDUs from the controller ------------------------------------------------------
    def _slot_for(self, cccid: int) -> Slot | None:
        index = cccid & 0xFFF
        if index >= self.depth:
            return None
        slot = self.slots[index]
        if not slot.busy or slot.cid != cccid or slot.raw is not None:
            return None
        return slot

    prechecked = frozenset((tcp_pdu.C2H_DATA, tcp_pdu.R2T))

    def precheck(self, ptype: int, flags: int, header: memoryview,
                 dlen: int) -> memoryview | None:
        """C2HData and R2T against the command they name; a C2HData's data goes straight
        to the command's memory (returned).  (_parse calls it for those two only:
        ``prechecked``.)"""
        cccid, _ttag, offset, length = _unpack_data_fields(header, 8)
        index = cccid & 0xFFF           # _slot_for, inline
        slot = self.slots[index] if index < self.depth else None
        data = self._data[index] if slot is not None and slot.busy and slot.cid == cccid \
            and slot.raw is None else None
        if data is None:
            raise tcp_pdu.PduError(f"PDU type {ptype:#x} for cid {cccid:#x}, which moves no data",
                                   tcp_pdu.Fes.INVALID_HEADER_FIELD, 8)
        if ptype == _C2H_DATA:
            if not data[3]:
                raise tcp_pdu.PduError(f"C2HData for cid {cccid:#x}, a write",
                                       tcp_pdu.Fes.INVALID_HEADER_FIELD, 8)
            if length != dlen:
                raise tcp_pdu.PduError(f"C2HData data length {length}, the PDU carries {dlen}",
                                       tcp_pdu.Fes.INVALID_HEADER_FIELD, 16)
            if offset != data[2] or offset + length > data[1]:
                raise tcp_pdu.PduError(f"C2HData {offset}+{length}: expected offset {data[2]} of "
                                       f"{data[1]}", tcp_pdu.Fes.DATA_OUT_OF_RANGE, 12)
            if flags & _F_SUCCESS:
                if not flags & _F_LAST:
                    raise tcp_pdu.PduError("C2HData SUCCESS without LAST",
                                           tcp_pdu.Fes.INVALID_HEADER_FIELD, tcp_pdu.FEI_FLAGS)
                if offset + length != data[1]:
                    raise tcp_pdu.PduError("C2HData SUCCESS before all the data (no short "
                                           "reads)", tcp_pdu.Fes.DATA_OUT_OF_RANGE, 16)
            # _c2h (next for this PDU: nothing is parsed between) takes them from here
            self._checked = (cccid, data, offset + length)
            return data[0][offset:offset + length]  # type: ignore[no-any-return]  # (a memoryview)
        else:
            if data[3]:
                raise tcp_pdu.PduError(f"R2T for cid {cccid:#x}, a read",
                                       tcp_pdu.Fes.INVALID_HEADER_FIELD, 8)
            # several may be outstanding (MAXR2T): each asks for the bytes after the last
            if not length or offset != data[2] or offset + length > data[1]:
                raise tcp_pdu.PduError(f"R2T {offset}+{length} for {data[1]} bytes, {data[2]} "
                                       "asked for before", tcp_pdu.Fes.DATA_OUT_OF_RANGE, 12)
            return None

    def _receive(self) -> bool:
        """One receive, as the connection's; once it has brought the answers to half of
        the commands in flight (at least SPLIT_MIN of them), what their completions issued
        goes out at once, and the target starts on it while the rest are handled (as
        HostQueue.handle_raw pushes on RDMA: two batches in motion, not one turn each)."""
        n = self.depth - len(self._free)
        self._half = n >> 1 if n >= SPLIT_MIN else -1
        self._answered = 0
        return PduConnection._receive(self)

    def on_pdu(self, ptype: int, flags: int, pdu: memoryview, pdo: int, dlen: int) -> None:
        if ptype == _C2H_DATA:                  # a read's data (and answer, with SUCCESS)
            self._c2h(flags, pdu, pdo, dlen, False)
            if flags & tcp_pdu.F_DATA_SUCCESS:
                k = self._answered = self._answered + 1
                if k == self._half:
                    self.flush()
            return
        elif ptype == tcp_pdu.CAPSULE_RESP:
            raw = _CQE_RAW.unpack_from(pdu, 8)
            slot = self._slot_for(raw[3])
            if slot is not None:
                index = slot.index
                data = self._data[index]
                # a success that moved less than all of a read's data (no C2HData, or not
                # to the end): the buffer holds no answer, so neither does the command
                if data is not None and not raw[4] & 0xFFFE and (
                        data[4] or (data[3] and data[2] != data[1])):
                    raw = raw[:4] + (_DATA_TRANSFER_ERROR,)
                if self._marks[index] > self._sent_total:
                    # answered before its data was all written (a hostile controller, or
                    # an early error): what is still queued must not follow the owner's
                    # memory once the owner has it back
                    self.detach_unsent(self._marks[index])
            self._on_cqe(raw)
            k = self._answered = self._answered + 1
            if k == self._half:
                self.flush()
        elif ptype == tcp_pdu.R2T:
            self._r2t(pdu)
        elif ptype == tcp_pdu.C2H_TERM:
            fes, fei = tcp_pdu.unpack_term(pdu) if len(pdu) >= 14 else (0, 0)
            raise_lost = f"the controller terminated the connection (FES {fes:#x}, FEI {fei})"
            self.on_lost(raise_lost)
        else:
            raise tcp_pdu.PduError(f"PDU type {ptype:#x} after initialisation",
                                   tcp_pdu.Fes.SEQUENCE_ERROR, 0)

    def on_data_digest_error(self, ptype: int, flags: int, pdu: memoryview, pdo: int,
                             dlen: int) -> None:
        if ptype != tcp_pdu.C2H_DATA:
            raise tcp_pdu.PduError("data digest mismatch", tcp_pdu.Fes.INVALID_HEADER_FIELD, 1)
        log.warning("%s: data digest mismatch in C2HData", self.name)
        self._c2h(flags, pdu, pdo, dlen, True)

    def _c2h(self, flags: int, pdu: memoryview, pdo: int, dlen: int, bad: bool) -> None:
        cccid, data, end = self._checked    # precheck's, the data in place
        data[2] = end
        if bad:
            data[4] = True
        if flags & tcp_pdu.F_DATA_SUCCESS:       # no CapsuleResp follows: success, unless bad
            raw = (0, 0xFFFF, self.qid, cccid, _DATA_TRANSFER_ERROR if data[4] else 0)
            slot = self.slots[cccid & 0xFFF]
            if slot.busy and slot.cid == cccid and slot.raw is None:   # precheck's, still
                slot.raw = raw
                if slot.sent:
                    self._complete(slot)
            else:
                self._on_cqe(raw)               # (which drops it, saying why)

    def _r2t(self, pdu: memoryview) -> None:
        cccid, ttag, offset, length = tcp_pdu.unpack_data_fields(pdu)
        # precheck made sure of the slot and its data
        index: int = self._slot_for(cccid).index  # type: ignore[union-attr]
        data: list[Any] = self._data[index]       # type: ignore[assignment]
        mem = data[0]
        end = offset + length
        out: list[Buf] = []
        hd, dd, align = self.hdgst, self.ddgst, self.tx_align
        while offset < end:
            n = min(self.maxh2cdata, end - offset)
            last = offset + n == end
            out.append(tcp_pdu.data_header(tcp_pdu.H2C_DATA, tcp_pdu.F_DATA_LAST if last else 0,
                                           cccid, ttag, offset, n, hd, dd, align))
            piece = mem[offset:offset + n]
            out.append(piece)
            if dd:
                out.append(tcp_pdu.pack_digest(tcp_pdu.digest(piece)))
            offset += n
        data[2] = end
        self._marks[index] = self.send(out)

    def fail(self, reason: str | QueueDead, *, expected: bool = False) -> None:
        """:meth:`HostQueue.fail`, once nothing more of this connection can land in or go
        out of the commands' memory, which their owners have back the moment they hear:
        on the reactor (where PDUs are read) the connection ends first (a C2HData half in
        would go on landing in a failed read's buffer); elsewhere, what is queued to go
        out is copied."""
        if self.reactor is not None and self.reactor.ident == _get_ident():
            PduConnection.close(self)
        else:
            self.detach_unsent(_NO_MARK)
        HostQueue.fail(self, reason, expected=expected)

    def _cut(self) -> None:
        """(fail() has ended the connection, or detached what it would send, already.)"""

    def on_lost(self, reason: str) -> None:
        if not self.closed:
            self.fail(reason, expected=False)
            PduConnection.close(self)

    def close(self) -> None:
        PduConnection.close(self)

    @property
    def broken(self) -> bool:
        return self.closed or self.dead_reason is not None
