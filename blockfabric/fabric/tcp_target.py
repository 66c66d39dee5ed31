"""The target's end of an NVMe/TCP queue: the same commands as on RDMA, moved by PDUs.

The controller logic (``blockfabric.target``) sees the very :class:`Command` objects and
queue methods it sees on RDMA (:class:`~blockfabric.fabric.target_side.TargetQueue`):
``fetch``/``fetch_to`` bring a command's host data into local memory, ``take_inline``
copies in-capsule data, ``respond``/``respond_ok`` answer with data.  Only how the data
moves differs:

* a CapsuleCmd's SQE (and in-capsule data) is copied into the command's slot, then decoded
  by the RDMA queue's own code (the same checks, the same statuses);
* an NVMe/TCP transport SGL (0x5A) is shown to that code as a keyed SGL without address or
  key ("data the transport moves"); a real keyed SGL is refused (SGL Descriptor Type
  Invalid), as in-capsule data with anything but an in-capsule SGL (Invalid Field);
* the host's data for a write is asked for by R2Ts of at most MAXH2CDATA bytes each, as
  many outstanding per command as the host's ICReq MAXR2T allows (0's based: the Linux
  host's 0 means one at a time; at most :data:`R2T_CAP`), the next sent as each one's data
  is complete; every H2CData is checked before its data is read (ttag, cccid, offset in
  order, length within the R2T it answers and within those sent, LAST on an R2T's last);
* read data goes as C2HData, with LAST, and with SUCCESS instead of a CapsuleResp when the
  host disabled SQ flow control at Connect (the Linux host does when discovery says so);
* a data digest error in a capsule or in H2CData fails that command (Transient Transport
  Error) and nothing else; every other violation is a C2HTermReq with its FES and the end
  of this connection (see :class:`~blockfabric.fabric.tcp.PduConnection`).

The queue's qid and depth come from the Fabrics Connect (TCP has no CM private data): the
queue has one command slot until then, like an RDMA queue's one receive.

Longer than ~500 lines because the per-I/O steps (a read's C2HData, a capsule's transport
SGL) are also written out inline, next to the general forms they shortcut: a Python call
costs more on that path than the lines it would save here.
"""

from __future__ import annotations

import logging
import struct
import threading
from time import monotonic as _monotonic
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

from blockfabric.fabric.target_side import Command, Handler, TargetQueue
from blockfabric.fabric.tcp import Buf, PduConnection, resolve
from blockfabric.protocol import CQE_SIZE, SQE_SIZE, StatusCode
from blockfabric.protocol import tcp_pdu
from blockfabric.protocol.capsule import pack_cqe_into
from blockfabric.protocol.opcodes import FABRICS_OPCODE
from blockfabric.protocol.sgl import KEYED_MAX_LENGTH, TYPE_KEYED, TYPE_OFFSET
from blockfabric.rdma import SGE

if TYPE_CHECKING:
    import socket

    from blockfabric.fabric.tcp import _LocalKeys
    from blockfabric.rdma.soft.memory import SoftPD

log = logging.getLogger(__name__)

#: MAXH2CDATA: the most data one H2CData PDU carries (the staging buffer's bound)
MAXH2CDATA = 128 << 10
#: how long after a receive the host's next command counts as due (seconds): the
#: reactor's busy-poll (its ``spin_us``, much shorter) runs for it only within this
EXPECT_AFTER_RX = 0.002
#: the most R2Ts outstanding per command, whatever MAXR2T the host asks for
R2T_CAP = 16
#: Transient Transport Error (SCT 0, SC 22h): a data digest that does not match
TRANSIENT_TRANSPORT_ERROR = 0x22
_SGL_WORDS = struct.Struct("<QQ")
_CONNECT_SIZES = struct.Struct("<HH")       # SQE @42 qid, @44 sqsize
_KEYED_WORD = TYPE_KEYED << 56
_NOT_RDMA = object()         # a Command's send_wr: never armed with RDMA work requests
_LAST_SUCCESS = tcp_pdu.F_DATA_LAST | tcp_pdu.F_DATA_SUCCESS
_TRANSPORT = tcp_pdu.SGL_TRANSPORT
_C2H_DATA = tcp_pdu.C2H_DATA
_pack_h24_into = tcp_pdu.pack_h24_into


class TcpHandler(Handler, Protocol):
    """A TCP queue's handler: it learns the queue's qid from the Connect (set by the
    queue before the handler sees that command)."""

    qid: int


class PeerInfo:
    """What the target asks of an RDMA CM id about its peer (``peer_address``)."""

    def __init__(self, address: tuple[Any, ...]) -> None:
        self.peer_address = address


class TcpTargetQueue(PduConnection):
    """One NVMe/TCP connection at the target: a queue of :class:`Command` slots."""

    pass_limit = 64     # read by the target's pass sharing; one read per wake-up here
    #: What the socket does not take stays queued by reference: a command is released
    #: (its slot, the volume's or a bounce buffer's memory it sent from) only once its
    #: bytes are written.  Copying instead cost a 1 MiB allocation and copy per 1 MiB read
    #: whenever the socket's buffer was full.
    copy_unsent = False

    def __init__(self, sock: socket.socket, pd: SoftPD[_LocalKeys], *, handler: TcpHandler,
                 inline_size: int, max_depth: Callable[[int], int], name: str,
                 cpda: int = 0) -> None:
        super().__init__(sock, name)
        self.pd = pd
        self.cmid = PeerInfo(sock.getpeername())
        self.handler = handler
        self.dispatch: Callable[[Command], None] = handler.handle
        self.qid = 0
        self.depth = 1
        self.max_depth = max_depth      # qid -> the largest depth a Connect may ask
        #: in-capsule bytes accepted: at least the 8 KiB a Linux host sends Fabrics
        #: commands with (IOCCSZ, advertised, may be less)
        self.inline_size = max(inline_size, tcp_pdu.ADMIN_CCSZ)
        self.sqhd = 0
        self.sq_flow = True
        self.connected = False
        self.commands: list[Command] = []
        self.recv_views: list[memoryview] = []
        self._free: list[int] = []
        #: per command slot, a transfer the host owes (R2Ts sent): [dest, got, total, bad,
        #: asked (the end of the last R2T sent), when the host last sent some of it]
        self._xfer: list[list[Any] | None] = []
        #: seconds a host may leave an R2T's data owed without sending any of it (read when
        #: checked, so a reload applies at once; None: no bound): the command holds the
        #: volume's memory and its in-flight count (a resize, a Preempt and Abort wait for
        #: it) until then.  The target sets limits.buffer_hold_timeout.
        self.data_timeout: Callable[[], float] | None = None
        self._hold_timer: Any = None
        #: answers the socket did not take (a host that does not read): where the stream
        #: stood and when, as last seen; the same bound applies (a Read's data is a view of
        #: the volume's memory, its command in flight until written)
        self._out_mark: tuple[int, float] | None = None
        self._cqes: list[bytearray] = []
        self._grow_slots(1)
        self.limits = tcp_pdu.Limits(max_capsule_data=self.inline_size)
        #: R2Ts outstanding per command (the host's MAXR2T + 1, capped), set by ICReq
        self.r2t_max = 1
        #: the data alignment asked of the host in ICResp (the listener's ``cpda``)
        self.cpda = cpda

    def _grow_slots(self, count: int) -> None:
        have = len(self.commands)
        for i in range(have, count):
            cmd = Command(self, i)      # type: ignore[arg-type]
            cmd.send_wr = _NOT_RDMA     # type: ignore[assignment]
            self.commands.append(cmd)
            self.recv_views.append(memoryview(bytearray(SQE_SIZE + self.inline_size)))
            self._xfer.append(None)
            self._cqes.append(bytearray(CQE_SIZE))
        self._free[:0] = range(count - 1, have - 1, -1)

    def post_more_receives(self) -> None:
        """The Connect succeeded: the queue's whole depth of command slots."""
        self.connected = True
        if not self.closed:
            self._grow_slots(self.depth)

    # -- what the RDMA queue's capsule decoding uses --------------------------------
    _on_capsule = TargetQueue._on_capsule
    _check_inline = TargetQueue._check_inline
    take_inline = TargetQueue.take_inline
    fetch = TargetQueue.fetch

    @property
    def outstanding(self) -> int:
        return len(self.commands) - len(self._free)

    def expecting(self) -> bool:
        """Commands in flight, or a receive within EXPECT_AFTER_RX: the host's next command
        is likely due (at QD1 it follows each answer within tens of microseconds), so the
        reactor spins for it before it sleeps (bounded by its ``spin_us``).  Never on the
        admin queue: the Asynchronous Event Requests held there would keep every wait of
        the loop spinning."""
        return bool(self.qid) and (len(self._free) < len(self.commands)
                                   or _monotonic() - self.rx_at < EXPECT_AFTER_RX)

    def in_flight(self) -> int:
        """I/O commands not yet answered (the reactor's spin follows it); the admin queue
        counts none: its Asynchronous Event Requests wait there for good."""
        return len(self.commands) - len(self._free) if self.qid else 0

    @property
    def broken(self) -> bool:
        return self.closed

    def close(self) -> None:
        if self._hold_timer is not None:
            self._hold_timer.cancel()
            self._hold_timer = None
        # a transfer cut short holds a view of the memory it was landing in (a volume's
        # mapping, which must not stay exported once the queue is gone)
        xfer = self._xfer
        for i, x in enumerate(xfer):
            if x is not None:
                xfer[i] = None
        PduConnection.close(self)

    # -- PDUs --------------------------------------------------------------------------
    def on_lost(self, reason: str) -> None:
        if not self.closed:
            self.handler.queue_broken(self, reason)

    def on_pdu(self, ptype: int, flags: int, pdu: memoryview, pdo: int, dlen: int) -> None:
        if ptype == tcp_pdu.CAPSULE_CMD:
            self._capsule(pdu, pdo, dlen, False)
        elif ptype == tcp_pdu.H2C_DATA:
            self._h2c_data(flags, pdu, pdo, dlen, False)
        elif ptype == tcp_pdu.ICREQ:
            req = tcp_pdu.ICReq.unpack(pdu)
            self.send([tcp_pdu.ICResp(cpda=self.cpda, hdgst=req.hdgst, ddgst=req.ddgst,
                                 maxh2cdata=MAXH2CDATA).pack()])
            self.r2t_max = min(req.maxr2t + 1, R2T_CAP)
            self.negotiated(req.hdgst, req.ddgst, self.inline_size, MAXH2CDATA, self.cpda,
                            req.hpda)
        else:                               # H2CTermReq: the host gives up
            fes, fei = tcp_pdu.unpack_term(pdu) if len(pdu) >= 14 else (0, 0)
            self.on_lost(f"the host sent a termination request (FES {fes:#x}, FEI {fei})")

    def on_data_digest_error(self, ptype: int, flags: int, pdu: memoryview, pdo: int,
                             dlen: int) -> None:
        log.warning("%s: data digest mismatch in a %s", self.name,
                    "capsule" if ptype == tcp_pdu.CAPSULE_CMD else "H2CData PDU")
        if ptype == tcp_pdu.CAPSULE_CMD:
            self._capsule(pdu, pdo, dlen, True)
        else:
            self._h2c_data(flags, pdu, pdo, dlen, True)

    prechecked = frozenset((tcp_pdu.H2C_DATA,))

    def precheck(self, ptype: int, flags: int, header: memoryview,
                 dlen: int) -> memoryview | None:
        """An H2CData's fields, before its data is read (nvmet's checks: a transfer the
        controller asked for, in order, within what it asked); its data goes straight to
        the memory the transfer lands in (returned).  (_parse calls it for H2CData only:
        ``prechecked``.)"""
        cccid, ttag, offset, length = tcp_pdu.unpack_data_fields(header)
        xfer = self._xfer[ttag] if ttag < len(self._xfer) else None
        if xfer is None:
            raise tcp_pdu.PduError(f"H2CData for ttag {ttag}, which has no R2T outstanding",
                                   tcp_pdu.Fes.INVALID_HEADER_FIELD, 10)
        if self.commands[ttag].cid != cccid:
            raise tcp_pdu.PduError(f"H2CData cccid {cccid:#x} is not ttag {ttag}'s command",
                                   tcp_pdu.Fes.INVALID_HEADER_FIELD, 8)
        if length != dlen:
            raise tcp_pdu.PduError(f"H2CData data length {length}, the PDU carries {dlen}",
                                   tcp_pdu.Fes.INVALID_HEADER_FIELD, 16)
        if offset != xfer[1]:
            raise tcp_pdu.PduError(f"H2CData offset {offset}, expected {xfer[1]} (in order)",
                                   tcp_pdu.Fes.DATA_OUT_OF_RANGE, 12)
        end = offset + length
        if end > xfer[4]:
            raise tcp_pdu.PduError(f"H2CData {offset}+{length} beyond the {xfer[4]} bytes asked "
                                   f"(of {xfer[2]})", tcp_pdu.Fes.DATA_OUT_OF_RANGE, 16)
        # the R2T this PDU answers ends at the next multiple of MAXH2CDATA (or the end)
        r2t_end = min(xfer[2], offset - offset % MAXH2CDATA + MAXH2CDATA)
        if end > r2t_end:
            raise tcp_pdu.PduError(f"H2CData {offset}+{length} crosses the end of its R2T at "
                                   f"{r2t_end}", tcp_pdu.Fes.DATA_OUT_OF_RANGE, 16)
        if bool(flags & tcp_pdu.F_DATA_LAST) != (end == r2t_end):
            raise tcp_pdu.PduError("H2CData LAST flag %s at %d, the R2T ends at %d" % (
                "set" if flags & tcp_pdu.F_DATA_LAST else "clear", end, r2t_end),
                tcp_pdu.Fes.INVALID_HEADER_FIELD, tcp_pdu.FEI_FLAGS)
        return xfer[0][offset:end]  # type: ignore[no-any-return]  # (xfer[0]: a memoryview)

    def _capsule(self, pdu: memoryview, pdo: int, dlen: int, bad_digest: bool) -> None:
        free = self._free
        if not free:
            raise tcp_pdu.PduError(f"more commands than the queue depth of {self.depth}",
                                   tcp_pdu.Fes.SEQUENCE_ERROR, 0)
        index = free[-1]
        slot = self.recv_views[index]
        slot[:SQE_SIZE] = pdu[8:8 + SQE_SIZE]
        if dlen:
            slot[SQE_SIZE:SQE_SIZE + dlen] = pdu[pdo:pdo + dlen]
        word = _SGL_WORDS.unpack_from(slot, 24)[1]
        if word >> 56 == _TRANSPORT and not dlen and word & 0xFFFFFFFF <= KEYED_MAX_LENGTH:
            # the data path's command (data in C2HData/H2CData PDUs): _transport_sgl's
            # rewrite, inline
            _SGL_WORDS.pack_into(slot, 24, 0, (word & 0xFFFFFFFF) | _KEYED_WORD)
            status = None
        else:
            status = self._transport_sgl(slot, dlen)
        if status is None and bad_digest:
            status = TRANSIENT_TRANSPORT_ERROR
        if status is None and not self.connected:
            status = self._connect_sizes(slot)
        if status is not None:
            cmd = self.commands[free.pop()]
            sqhd = self.sqhd + 1        # (fetched: the SQ head moves, as _on_capsule's)
            self.sqhd = sqhd if sqhd < self.depth else 0
            cmd.recv_index = index
            cmd.responded = False
            cmd.on_fetched = cmd.on_released = cmd.user = None
            cmd.sgl_type = None
            cmd.cid = int.from_bytes(slot[2:4], "little")
            self.respond(cmd, status, dnr=status != TRANSIENT_TRANSPORT_ERROR)
            return
        self._on_capsule(index, SQE_SIZE + dlen)

    def _transport_sgl(self, slot: memoryview, dlen: int) -> int | None:
        """Present an NVMe/TCP SGL to the RDMA queue's decoding (see the module text);
        the status of one that NVMe/TCP does not allow."""
        addr, word = _SGL_WORDS.unpack_from(slot, 24)
        kind = word >> 56
        if kind == tcp_pdu.SGL_TRANSPORT:
            if dlen:
                return StatusCode.INVALID_FIELD             # data both ways: nvmet's 0x2
            length = word & 0xFFFFFFFF
            if length > KEYED_MAX_LENGTH:
                return StatusCode.SGL_DATA_LENGTH_INVALID
            _SGL_WORDS.pack_into(slot, 24, 0, length | _KEYED_WORD)
            return None
        if kind == TYPE_OFFSET:
            return None
        return StatusCode.SGL_DESCRIPTOR_TYPE_INVALID

    def _connect_sizes(self, slot: memoryview) -> int | None:
        """Before the queue is connected: a Fabrics Connect names the queue's qid and depth
        (bounded as the RDMA CM request's are); anything else is the session's to refuse."""
        if slot[0] != FABRICS_OPCODE or slot[4] != 0x01:
            return None
        qid, sqsize = _CONNECT_SIZES.unpack_from(slot, 42)
        if sqsize + 1 > self.max_depth(qid) or sqsize < 1:
            return StatusCode.CONNECT_INVALID_PARAM
        self.qid = qid
        self.depth = sqsize + 1
        self.handler.qid = qid
        self.name = f"{self.name.rsplit(' q', 1)[0]} q{qid}"
        return None

    def _h2c_data(self, flags: int, pdu: memoryview, pdo: int, dlen: int,
                  bad_digest: bool) -> None:
        cccid, ttag, offset, length = tcp_pdu.unpack_data_fields(pdu)
        # precheck made sure of it, and put the data in place
        xfer: list[Any] = self._xfer[ttag]  # type: ignore[assignment]
        end = xfer[1] = offset + length
        xfer[5] = _monotonic()
        if bad_digest:
            xfer[3] = True
        if end < xfer[2]:
            asked = xfer[4]
            if not end % MAXH2CDATA and asked < xfer[2]:
                # an R2T's data is complete: ask for the next piece
                n = min(MAXH2CDATA, xfer[2] - asked)
                xfer[4] = asked + n
                self.send([tcp_pdu.data_header(tcp_pdu.R2T, 0, cccid, ttag, asked, n, self.hdgst,
                                               False)])
            return
        self._xfer[ttag] = None
        cmd = self.commands[ttag]
        done, cmd.on_fetched = cmd.on_fetched, None
        if xfer[3]:
            # the data cannot be trusted: undo what the command holds, answer it
            undo, cmd.user = cmd.user, None
            if undo is not None:
                undo(cmd)
            self.respond(cmd, TRANSIENT_TRANSPORT_ERROR)
        elif done is not None:
            done(cmd)

    # -- data movement (what the controller calls) ------------------------------------
    def fetch_to(self, cmd: Command, addr: int, length: int, lkey: int,
                 done: Callable[[Command], None]) -> None:
        """Ask the host for the command's data (R2Ts of at most MAXH2CDATA bytes, up to
        the host's MAXR2T of them at once) to land in ``length`` bytes of local memory at
        ``addr``; ``done(cmd)`` once it is there."""
        length = min(length, cmd.data_length)
        if self.closed:
            return
        if not length:
            done(cmd)
            return
        cid, index, hd = cmd.cid, cmd.index, self.hdgst
        if length <= MAXH2CDATA:
            self._xfer[index] = [resolve(self.pd, addr, length, lkey), 0, length, False,
                                 length, _monotonic()]
            cmd.on_fetched = done
            if self._hold_timer is None:
                self._watch_data()
            self.send([tcp_pdu.data_header(tcp_pdu.R2T, 0, cid, index, 0, length, hd, False)])
            return
        asked = min(length, self.r2t_max * MAXH2CDATA)
        self._xfer[index] = [resolve(self.pd, addr, length, lkey), 0, length, False, asked,
                             _monotonic()]
        cmd.on_fetched = done
        if self._hold_timer is None:
            self._watch_data()
        self.send([tcp_pdu.data_header(tcp_pdu.R2T, 0, cid, index, off,
                                       min(MAXH2CDATA, asked - off), hd, False)
                   for off in range(0, asked, MAXH2CDATA)])

    def _watch_data(self, delay: float | None = None) -> None:
        """Check the data owed against ``data_timeout`` in ``delay`` seconds (the bound)."""
        bound = self.data_timeout
        if bound is not None and self.reactor is not None and not self.closed:
            self._hold_timer = self.reactor.call_later(
                bound() if delay is None else delay, self._check_data)

    def _schedule_retry(self, moved: bool = True) -> None:
        """:meth:`PduConnection._schedule_retry`; and the socket left answers unsent: watch
        that the host reads them (see :meth:`_check_data`)."""
        PduConnection._schedule_retry(self, moved)
        if self._out_mark is not None or self.data_timeout is None:
            return
        self._out_mark = (self._sent_total, _monotonic())
        reactor = self.reactor
        if reactor is None:
            return
        if reactor.ident == threading.get_ident():
            if self._hold_timer is None:
                self._watch_data()
        else:
            reactor.call_soon_threadsafe(
                lambda: self._watch_data() if self._hold_timer is None else None)

    def _check_data(self) -> None:
        """A host that owes an R2T's data and sent none of it for ``data_timeout`` seconds
        loses the queue (its commands are undone: the volume's memory, in-flight counts);
        the kernel's nvmet has no such bound.  So does one that reads none of its answers
        for as long: a Read's data waits as a view of the volume, its command in flight,
        until the socket takes it."""
        self._hold_timer = None
        if self.closed or self.data_timeout is None:
            return
        bound, now, idle = self.data_timeout(), _monotonic(), -1.0
        for x in self._xfer:
            if x is not None:
                idle = max(idle, now - x[5])
        unread = -1.0
        mark = self._out_mark
        if mark is not None:
            if not self._out:
                self._out_mark = None           # all written
            elif self._sent_total != mark[0]:
                self._out_mark = (self._sent_total, now)    # it reads: from now on
                unread = 0.0
            else:
                unread = now - mark[1]
        if idle >= bound:
            self.on_lost(f"the host owed an R2T's data and sent none for {idle:.0f} s "
                         f"(limits.buffer_hold_timeout {bound:g} s)")
        elif unread >= bound:
            self.on_lost(f"the host read none of its answers for {unread:.0f} s "
                         f"(limits.buffer_hold_timeout {bound:g} s)")
        elif idle >= 0 or unread >= 0:
            self._watch_data(bound - max(idle, unread))

    def respond(self, cmd: Command, status: int = StatusCode.SUCCESS, *, dnr: bool = False,
                result: int = 0, data: Sequence[SGE] = (), cid: int | None = None) -> None:
        if cmd.responded or self.closed:
            return
        cmd.responded = True
        cid = cmd.cid if cid is None else cid
        if data and status == StatusCode.SUCCESS and cmd.sgl_type == TYPE_KEYED:
            want = cmd.data_length
            views: list[Buf] = []
            for sge in data:
                if want <= 0:
                    break
                n = min(sge.length, want)
                views.append(resolve(self.pd, sge.addr, n, sge.lkey))
                want -= n
            if want > 0:
                views.append(bytes(want))   # a host reads exactly what it asked for
            out = self._c2h(cmd, views, cmd.data_length, result == 0)
            if result == 0 and not self.sq_flow:
                self.send(out, cmd)         # SUCCESS on the last C2HData: no CapsuleResp
                return
        else:
            out = []
        cqe = self._cqes[cmd.index]
        pack_cqe_into(cqe, 0, cid, status, result=result,
                      sq_head=self.sqhd if self.sq_flow else 0xFFFF, sq_id=self.qid, dnr=dnr)
        out.append(tcp_pdu.capsule_resp(cqe, self.hdgst))
        self.send(out, cmd)

    def respond_ok(self, cmd: Command, addr: int = 0, length: int = 0, lkey: int = 0) -> None:
        if cmd.responded or self.closed:
            return
        if length and cmd.sgl_type == TYPE_KEYED:
            cmd.responded = True
            hd = self.hdgst
            if length <= MAXH2CDATA and not self.ddgst:
                # the common read: one C2HData PDU (and the CapsuleResp under SQ flow
                # control), one send
                if self.sq_flow:
                    cqe = self._cqes[cmd.index]
                    pack_cqe_into(cqe, 0, cmd.cid, 0, sq_head=self.sqhd, sq_id=self.qid)
                    self.send([tcp_pdu.data_header(tcp_pdu.C2H_DATA, tcp_pdu.F_DATA_LAST,
                                                   cmd.cid, 0, 0, length, hd, False,
                                                   self.tx_align),
                               resolve(self.pd, addr, length, lkey),
                               tcp_pdu.capsule_resp(cqe, hd)], cmd)
                elif not hd and self.tx_align == 4:     # data_header's plain case, inline
                    head = bytearray(24)
                    _pack_h24_into(head, 0, _C2H_DATA, _LAST_SUCCESS, 24, 24, 24 + length,
                                   cmd.cid, 0, 0, length)
                    self.send((head, resolve(self.pd, addr, length, lkey)), cmd)
                else:
                    self.send([tcp_pdu.data_header(tcp_pdu.C2H_DATA, _LAST_SUCCESS, cmd.cid, 0, 0,
                                                   length, hd, False, self.tx_align),
                               resolve(self.pd, addr, length, lkey)], cmd)
                return
            out = self._c2h(cmd, [resolve(self.pd, addr, length, lkey)], length, True)
            if self.sq_flow:
                cqe = self._cqes[cmd.index]
                pack_cqe_into(cqe, 0, cmd.cid, 0, sq_head=self.sqhd, sq_id=self.qid)
                out.append(tcp_pdu.capsule_resp(cqe, hd))
            self.send(out, cmd)
            return
        self.respond(cmd)

    def _c2h(self, cmd: Command, views: list[Buf], length: int, may_succeed: bool
             ) -> list[Buf]:
        """The C2HData PDUs carrying ``views`` (``length`` bytes): one per MAXH2CDATA
        bytes, LAST on the final one, and SUCCESS there too when no CapsuleResp follows."""
        success = may_succeed and not self.sq_flow
        hd, dd, align = self.hdgst, self.ddgst, self.tx_align
        out: list[Buf] = []
        offset = 0
        pending = list(views)
        while offset < length:
            n = min(MAXH2CDATA, length - offset)
            piece: list[Buf] = []
            take = n
            while take:
                v = pending[0]
                if len(v) <= take:
                    piece.append(v)
                    take -= len(v)
                    pending.pop(0)
                else:
                    piece.append(v[:take])
                    pending[0] = v[take:]
                    take = 0
            last = offset + n == length
            flags = ((tcp_pdu.F_DATA_LAST | (tcp_pdu.F_DATA_SUCCESS if success else 0))
                     if last else 0)
            out.append(tcp_pdu.data_header(tcp_pdu.C2H_DATA, flags, cmd.cid, 0, offset, n, hd, dd,
                                           align))
            out.extend(piece)
            if dd:
                crc = 0
                for p in piece:
                    crc = tcp_pdu.digest(p, crc)
                out.append(tcp_pdu.pack_digest(crc))
            offset += n
        return out

    def released(self, cmd: Command) -> None:
        """The answer is written (or copied): what it read may be reused, the slot too."""
        released = cmd.on_released
        if released is not None:
            cmd.on_released = None
            released(cmd)
        if not self.closed:
            self._free.append(cmd.index)


#: A target queue of either transport, as the controller logic (blockfabric.target) sees it.
AnyTargetQueue = TargetQueue | TcpTargetQueue
