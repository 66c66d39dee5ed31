"""What both ends of an NVMe/TCP queue share: the local memory keys and the PDU connection.

**Memory.**  Above the transport, the target and the host name data by (address, length,
key) in memory registered with a protection domain, as on RDMA.  On TCP nothing remote ever
reads that memory: :func:`local_pd` gives a protection domain of the soft provider's kind
(registration pins the buffer and yields its address and keys) with no device behind it,
and :func:`resolve` turns an (address, length, key) back into a view of those bytes, checked
against the region's bounds.  The addresses and keys come from this process's own code, never
from the wire (an NVMe/TCP SGL carries no address).

**The connection** (:class:`PduConnection`): one TCP socket, driven by one reactor.
Receiving is one ``recv_into`` per wake-up into a staging buffer that starts small and grows
only to the size of a PDU whose header was checked (bounded by what the receiver
negotiated); every complete PDU of the read is handled in that pass.  Every PDU header is
checked (:func:`~blockfabric.protocol.tcp_pdu.check_header`), its header digest verified and
the side's :meth:`PduConnection.precheck` run *before* the staging buffer grows for its data.
A violation sends a termination request with its FES and closes: only this connection.
Sending collects every PDU of a pass and writes them with one ``sendmsg`` at its end
(:meth:`PduConnection.flush`); what the socket does not take at once is copied and sent when
it can, and past ``max_unsent`` bytes the connection stops reading until it drained, so a
peer that does not read cannot make the other end buffer without bound.

Why one module of ~530 lines: the receive parser, the direct placement of large data PDUs
and the batched writer share the connection's buffers and counters and run on every PDU
(one pass per wake-up); the memory keys sit beside them because both sides resolve every
command's data through :func:`resolve`.
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
from time import monotonic as _monotonic
from typing import TYPE_CHECKING, Any, Sequence

from blockfabric.protocol import tcp_pdu
from blockfabric.rdma.soft.memory import KeyAllocator, SoftMR, SoftPD

if TYPE_CHECKING:
    from blockfabric.fabric.reactor import Reactor, Timer

log = logging.getLogger(__name__)

#: what a connection sends: PDU headers and the memory their data is in
Buf = bytes | bytearray | memoryview

_unpack_header = tcp_pdu.COMMON.unpack_from       # tcp_pdu.header, without the call
_CAPSULE_CMD = tcp_pdu.CAPSULE_CMD
_CAPSULE_RESP = tcp_pdu.CAPSULE_RESP
_C2H_DATA, _DATA_SUCCESS = tcp_pdu.C2H_DATA, tcp_pdu.F_DATA_SUCCESS

#: the staging buffer's first size: a connection that only connects costs this
STAGING_START = 4096
#: the most it grows to (past the largest PDU it must hold) when receives keep filling it:
#: a connection with many small PDUs in flight reads them all with one receive per wake-up
STAGING_MAX = 256 << 10
#: a data PDU (C2HData, H2CData) carrying at least this much goes straight into the memory
#: its command names once its header is in (see PduConnection._start_direct)
DIRECT_MIN = 32 << 10
#: a send the socket did not take whole is retried after RETRY_FIRST (seconds) when the
#: socket took some of it, else after twice the last wait, up to RETRY_MAX: a peer reading
#: as fast as it can (a 1 MiB C2HData, 16 segments) is not held up by a 0.5 ms timer (seq
#: read 1M over NVMe/TCP 1.07x), one that stopped reading costs no more wake-ups than before
RETRY_FIRST = 0.00005
RETRY_MAX = 0.0005
IOV_MAX = 512


class _LocalKeys:
    """What a :class:`~blockfabric.rdma.soft.memory.SoftPD` needs of its device: key tables
    and a key allocator (here for memory that only this process reads)."""

    def __init__(self) -> None:
        self.lkeys: dict[int, SoftMR] = {}
        self.rkeys: dict[int, SoftMR] = {}
        self._keys = KeyAllocator()
        self._lock = threading.Lock()

    def new_keys(self) -> tuple[int, int]:
        with self._lock:
            return self._keys.pair()


def local_pd() -> SoftPD[_LocalKeys]:
    """A protection domain for memory that a TCP queue moves (see the module text)."""
    return SoftPD(_LocalKeys())


def resolve(pd: SoftPD[_LocalKeys], addr: int, length: int, key: int) -> memoryview:
    """The ``length`` bytes at ``addr`` in the region of ``pd`` whose lkey or rkey is
    ``key``; ValueError when they are not all inside one of its regions."""
    ctx = pd.ctx
    mr = ctx.lkeys.get(key) or ctx.rkeys.get(key)
    if mr is None or mr.pd is not pd or mr.closed:
        raise ValueError(f"no memory region with key {key:#x}")
    start = addr - mr.addr
    if start < 0 or length < 0 or start + length > mr.length:
        raise ValueError(f"{length} bytes at {addr:#x} outside the region of key {key:#x}")
    return mr.buf[start:start + length]


def tune(sock: socket.socket) -> None:
    """No Nagle (the Linux host and nvmet both set TCP_NODELAY), non-blocking."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setblocking(False)


class PduConnection:
    """One NVMe/TCP connection's framing (see the module text).  A side overrides
    :meth:`on_pdu` (and :meth:`precheck`, :meth:`on_data_digest_error`, :meth:`on_lost`)."""

    #: the termination request this side sends (C2H for a controller, H2C for a host)
    term_type = tcp_pdu.C2H_TERM
    #: copy what the socket did not take (False: a side whose queued buffers all stay
    #: valid until the peer has read them)
    copy_unsent = True
    to_controller = True
    #: the PDU types :meth:`precheck` looks at (a side that overrides it names them)
    prechecked: frozenset[int] = frozenset()

    def __init__(self, sock: socket.socket, name: str) -> None:
        tune(sock)
        self.sock = sock
        self.name = name
        self.closed = False
        self.initialized = False
        self.limits = tcp_pdu.Limits(max_capsule_data=tcp_pdu.ADMIN_CCSZ)
        #: the PDU types whose plain headers _parse takes without check_header's call (see
        #: negotiated): type -> (hlen, flags not allowed, most data bytes, may carry none)
        self._plain: dict[int, tuple[int, int, int, bool]] = {}
        self.hdgst = self.ddgst = False
        self.tx_align = 4
        self._staging = bytearray(STAGING_START)
        self._view = memoryview(self._staging)
        self._filled = 0
        self._out: list[Buf] = []
        self._out_bytes = 0
        self._sent_total = 0            # bytes written since the start (send()'s marks)
        self._sent_upto = 0             # ... or copied, so they may be taken as written
        #: (mark, item): ``item`` given to :meth:`released` once the stream is written up
        #: to ``mark`` (or what is left of it copied): the memory it referenced may then
        #: be reused
        self._after: list[tuple[int, Any]] = []
        self._flush_queued = False
        #: PDUs of a receive are being handled: what they send goes out at its end
        self._in_pass = False
        #: when the last receive brought bytes (time.monotonic)
        self.rx_at = 0.0
        #: a data PDU being received straight into its memory: [type, flags, header (its
        #: first pdo bytes), destination view, bytes in, data length], or None
        self._direct: list[Any] | None = None
        self._paused = False
        self._retry: Timer | None = None
        self._retry_delay = RETRY_FIRST
        self.max_unsent = 64 << 20
        self.reactor: Reactor | None = None
        self._send_lock = threading.RLock()

    # -- the reactor ---------------------------------------------------------------
    def attach(self, reactor: Reactor) -> None:
        """Serve the connection on ``reactor``: its socket's readiness, and its busy-poll
        (``Reactor.add_poller``: before the loop sleeps, it polls the socket while
        :meth:`expecting` says an answer is due; see :meth:`poll`)."""
        self.reactor = reactor

        def register() -> None:
            reactor.add_reader(self.sock.fileno(), self.on_readable)
            add_poller = getattr(reactor, "add_poller", None)
            if add_poller is not None:
                add_poller(self.poll, self.in_flight)
        reactor.call_sync(register)

    def release_reactor(self) -> None:
        """Leave the reactor, socket open: its reader and its busy-poll go (a queue handed
        to another process, whose copy of the socket carries on).  On the reactor's
        thread."""
        self._detach()

    def _detach(self) -> None:
        reactor, self.reactor = self.reactor, None
        if reactor is None:
            return
        fd = self.sock.fileno()

        def unregister() -> None:
            reactor.remove_reader(fd, self.on_readable)
            remove_poller = getattr(reactor, "remove_poller", None)
            if remove_poller is not None:
                remove_poller(self.poll)
        if reactor.thread is None or reactor.thread is threading.current_thread():
            unregister()
        else:
            try:
                reactor.call_sync(unregister)
            except TimeoutError as exc:
                log.warning("%s: %s", self.name, exc)

    def fileno(self) -> int:
        return self.sock.fileno()

    # -- receiving -----------------------------------------------------------------
    def on_readable(self) -> None:
        if not self.closed and not self._paused:
            self._receive()

    def poll(self) -> bool | None:
        """The reactor's busy-poll (``Reactor.add_poller``): one non-blocking receive when
        an answer is due (:meth:`expecting`), handled as a wake-up's would be; True if
        something came, False if not yet, None when nothing is due (no point spinning)."""
        if self.closed or self._paused or not self.expecting():
            return None
        return self._receive()

    def expecting(self) -> bool:
        """Whether the peer is due to send soon (a side overrides it): while so, the
        reactor polls the socket for up to its ``spin_us`` before it sleeps."""
        return False

    def in_flight(self) -> int:
        """Commands outstanding on this connection (a side overrides it): above
        ``reactor.SPIN_MAX_DEPTH`` the reactor does not spin."""
        return 0

    def _receive(self) -> bool:
        """One ``recv_into`` the staging buffer, every complete PDU in it handled, and what
        they queued written with one ``sendmsg``; False when nothing had arrived."""
        view = self._view
        room = len(view)
        filled = self._filled
        direct = self._direct
        try:
            if direct is None:
                n = self.sock.recv_into(view[filled:])
            else:
                # the rest of the data into its memory, what follows into the staging buffer
                rest = direct[5] - direct[4]
                n = self.sock.recvmsg_into([direct[3][direct[4]:], view[filled:]])[0]
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as exc:
            self.on_lost(f"connection failed: {exc.strerror or exc}")
            return True
        if not n:
            self.on_lost("peer disconnected")
            return True
        if direct is not None:
            if n < rest:
                direct[4] += n
                self.rx_at = _monotonic()
                return True
            direct[4] = direct[5]
            n -= rest
        filled += n
        self._filled = filled
        self.rx_at = _monotonic()
        self._in_pass = True
        try:
            self._parse()
        except tcp_pdu.PduError as exc:
            self._end_pass()
            self.terminate(exc)
            return True
        except Exception as exc:          # a bug: this connection only
            self._end_pass()
            log.error("%s: PDU handling failed", self.name, exc_info=True)
            self.on_lost(f"PDU handling failed: {type(exc).__name__}: {exc}")
            return True
        self._end_pass()
        if filled == room and room < STAGING_MAX and self._view is view and \
                self._direct is None and self.initialized and not self.closed:
            # the receive filled the buffer: more was waiting, so read more at once next
            self._grow(min(STAGING_MAX, 2 * room), 0, self._filled)
        return True

    def _end_pass(self) -> None:
        """The receive's PDUs are handled: write what they queued (one ``sendmsg``)."""
        with self._send_lock:
            self._in_pass = False
            if self._out and not self.closed:
                self._flush_queued = False
                self._write()

    def _parse(self) -> None:
        view = self._view
        filled = self._filled
        pos = 0
        limits = self.limits
        plain = self._plain
        prechecked = self.prechecked
        start = -1                          # where the PDU being parsed starts (-1: none)
        capsules = 0                        # commands or answers: see note_arrivals
        try:
            if self._direct is not None:
                pos = self._finish_direct(view, filled)
                if self._direct is not None:
                    return              # its data digest is not in yet
            while not self.closed:
                start = pos
                avail = filled - pos
                if avail < tcp_pdu.COMMON_SIZE:
                    break
                ptype, flags, hlen, pdo, plen = _unpack_header(view, pos)
                shape = plain.get(ptype)
                if shape is not None and hlen == shape[0] and not flags & shape[1] and (
                        (pdo == hlen and 0 < plen - hlen <= shape[2])
                        or (shape[3] and not pdo and plen == hlen)):
                    dlen = plen - hlen if pdo else 0
                else:
                    dlen = tcp_pdu.check_header(ptype, flags, hlen, pdo, plen,
                                                to_controller=self.to_controller,
                                                initialized=self.initialized, limits=limits)
                digested = limits.hdgst and ptype > tcp_pdu.C2H_TERM
                head = hlen + (tcp_pdu.DIGEST_SIZE if digested else 0)
                if avail < head:
                    if head > len(view):
                        self._grow(head, pos, filled)
                        pos = 0             # the new buffer starts with this PDU
                        return
                    break
                if digested and tcp_pdu.digest(view[pos:pos + hlen]) != \
                        tcp_pdu.unpack_digest(view, pos + hlen)[0]:
                    raise tcp_pdu.PduError("header digest mismatch", tcp_pdu.Fes.HEADER_DIGEST,
                                           hlen)
                dest = self.precheck(ptype, flags, view[pos:pos + hlen], dlen) \
                    if ptype in prechecked else None
                if avail < plen:
                    if dest is not None and dlen >= DIRECT_MIN and pdo <= avail < pdo + dlen:
                        pos = self._start_direct(ptype, flags, view, pos, filled, pdo, dlen,
                                                 dest)
                        return
                    if plen > len(view):
                        self._grow(plen, pos, filled)
                        pos = 0
                        return
                    break
                pdu = view[pos:pos + plen]
                pos += plen
                if dest is not None:
                    dest[:] = pdu[pdo:pdo + dlen]
                if dlen and limits.ddgst and ptype > tcp_pdu.C2H_TERM and \
                        tcp_pdu.digest(pdu[pdo:pdo + dlen]) != \
                        tcp_pdu.unpack_digest(pdu, plen - 4)[0]:
                    self.on_data_digest_error(ptype, flags, pdu, pdo, dlen)
                else:
                    self.on_pdu(ptype, flags, pdu, pdo, dlen)
                if ptype == _CAPSULE_CMD or ptype == _CAPSULE_RESP or \
                        (ptype == _C2H_DATA and flags & _DATA_SUCCESS):
                    capsules += 1           # a command, or an answer (a read's may be data)
                limits = self.limits        # ICReq/ICResp change them
                plain = self._plain
        except tcp_pdu.PduError as exc:
            # the offending PDU's header as far as it came, up to 128 bytes: not its data,
            # nor the PDUs after it (and nothing when the error is not one PDU's here: a
            # payload received straight into memory)
            shown = view[start + 2] if 0 <= start and filled - start > 2 else 0   # its hlen
            exc.offending = bytes(view[start:min(filled, start + shown, start
                                                 + tcp_pdu.TERM_MAX_PLEN - tcp_pdu.TERM_HLEN)])
            raise
        finally:
            if capsules > 1:
                note = getattr(self.reactor, "note_arrivals", None)
                if note is not None:
                    note(capsules)
            if not self.closed and pos:
                rest = filled - pos
                if rest:
                    self._staging[:rest] = self._staging[pos:filled]
                self._filled = rest
            elif self.closed:
                self._filled = 0

    def _start_direct(self, ptype: int, flags: int, view: memoryview, pos: int, filled: int,
                      pdo: int, dlen: int, dest: memoryview) -> int:
        """A large data PDU whose header is in and whose data is not all: the data in the
        staging buffer goes to ``dest`` (the memory of its command, from
        :meth:`precheck`), and the receives that follow put the rest straight there
        (``recvmsg_into`` the rest of ``dest`` and the staging buffer: still one receive
        per wake-up, and no copy).  Returns the new parse position (all consumed)."""
        have = filled - pos - pdo
        if have:
            dest[:have] = view[pos + pdo:filled]
        self._direct = [ptype, flags, bytes(view[pos:pos + pdo]), dest, have, dlen]
        return filled

    def _finish_direct(self, view: memoryview, filled: int) -> int:
        """The data of the PDU received straight into its memory is all in: check its data
        digest (the 4 bytes now at the staging buffer's start) and hand the PDU on;
        returns the parse position after it (0 and the PDU kept while its digest is not
        in yet)."""
        ptype, flags, header, dest, _got, dlen = self._direct  # type: ignore[misc]  # (it is set)
        pos = 0
        bad = False
        if self.limits.ddgst:
            if filled < tcp_pdu.DIGEST_SIZE:
                return 0
            bad = tcp_pdu.digest(dest) != tcp_pdu.unpack_digest(view, 0)[0]
            pos = tcp_pdu.DIGEST_SIZE
        self._direct = None
        head = memoryview(header)
        if bad:
            self.on_data_digest_error(ptype, flags, head, len(header), dlen)
        else:
            self.on_pdu(ptype, flags, head, len(header), dlen)
        return pos

    def _grow(self, size: int, pos: int, filled: int) -> None:
        """A new staging buffer that holds a PDU of ``size`` bytes (its header checked),
        with the bytes of it already received at its start."""
        new = bytearray(max(size, 2 * len(self._staging)) if size < 65536 else size)
        rest = filled - pos
        new[:rest] = self._view[pos:filled]
        self._view.release()
        self._staging = new
        self._view = memoryview(new)
        self._filled = rest

    def precheck(self, ptype: int, flags: int, header: memoryview,
                 dlen: int) -> memoryview | None:
        """The PDU's header is in (and its digest right), its data not yet: raise
        :class:`~blockfabric.protocol.tcp_pdu.PduError` if it must not be read on.  For a
        data PDU, return the ``dlen`` bytes of memory its data goes to: the connection
        puts it there (received straight into it when large) before :meth:`on_pdu`,
        whose ``pdu`` may then hold only the header.  It is called only for the types in
        :attr:`prechecked`."""
        return None

    def on_pdu(self, ptype: int, flags: int, pdu: memoryview, pdo: int, dlen: int) -> None:
        """A whole PDU (valid as far as the common checks go); ``pdu`` is only valid during
        the call."""
        raise NotImplementedError

    def on_data_digest_error(self, ptype: int, flags: int, pdu: memoryview, pdo: int,
                             dlen: int) -> None:
        raise tcp_pdu.PduError("data digest mismatch", tcp_pdu.Fes.INVALID_HEADER_FIELD,
                               tcp_pdu.FEI_FLAGS)

    def on_lost(self, reason: str) -> None:
        """The connection cannot go on: tear down (overridden by each side)."""
        self.close()

    def negotiated(self, hdgst: bool, ddgst: bool, max_capsule_data: int,
                   max_data: int, rx_pda: int, tx_pda: int) -> None:
        """ICReq/ICResp are done: the digests, the receive limits, the data alignment this
        side asked for (``rx_pda``) and the one the peer asked for (``tx_pda``, that of
        the data PDUs this side sends: :attr:`tx_align` bytes)."""
        self.initialized = True
        self.hdgst, self.ddgst = hdgst, ddgst
        self.tx_align = tcp_pdu.align_of(tx_pda)
        self.limits = limits = tcp_pdu.Limits(hdgst, ddgst, max_capsule_data, max_data,
                                              tcp_pdu.align_of(rx_pda))
        # Without digests and with data right after the header, the PDUs of the data path
        # have one plain shape each; _parse checks a header of that shape inline, which
        # accepts a subset of what check_header accepts (anything else is checked there).
        plain: dict[int, tuple[int, int, int, bool]] = {}
        if not hdgst and not ddgst and limits.align == 4:
            if self.to_controller:
                plain[tcp_pdu.CAPSULE_CMD] = (72, 0xFF, max_capsule_data, True)
                plain[tcp_pdu.H2C_DATA] = (24, 0xFF & ~tcp_pdu.F_DATA_LAST, max_data, False)
            else:
                plain[tcp_pdu.CAPSULE_RESP] = (24, 0xFF, 0, True)
                plain[tcp_pdu.R2T] = (24, 0xFF, 0, True)
                plain[tcp_pdu.C2H_DATA] = (24, 0xFF & ~(tcp_pdu.F_DATA_LAST | _DATA_SUCCESS),
                                           max_data, False)
        self._plain = plain

    def terminate(self, exc: tcp_pdu.PduError) -> None:
        """Send a termination request for ``exc`` (FES, FEI, the offending header) after
        whatever is already queued, then end the connection."""
        if self.closed:
            return
        log.debug("%s: terminating the connection: %s (FES %#x, FEI %d)", self.name, exc,
                    exc.fes, exc.fei)
        with self._send_lock:
            # best effort and never blocking: a peer that does not read gets no more
            self._out.append(tcp_pdu.term_req(self.term_type, exc.fes, exc.fei,
                                         getattr(exc, "offending", b"")))
            self._write()
        self.on_lost(f"protocol error: {exc} (termination request sent, FES {exc.fes:#x})")

    # -- sending -------------------------------------------------------------------
    def send(self, bufs: Sequence[Buf], after: Any = None) -> int:
        """Queue ``bufs`` to go out with the rest of this pass: at the end of the receive
        whose PDUs are being handled, else in the reactor's next pass (``after``: given
        to :meth:`released` once they are written or copied).  Returns their end in the
        stream, for :meth:`detach_unsent`."""
        with self._send_lock:
            out = self._out
            for b in bufs:
                out.append(b)
                self._out_bytes += len(b)
            mark = self._sent_total + self._out_bytes
            if after is not None:
                self._after.append((mark, after))
            if self._in_pass or self._flush_queued or self.reactor is None:
                return mark
            self._flush_queued = True
        reactor = self.reactor
        if reactor.ident == threading.get_ident():
            reactor.call_soon(self.flush)
        else:
            reactor.call_soon_threadsafe(self.flush)
        return mark

    def detach_unsent(self, mark: int) -> None:
        """What was queued up to ``mark`` (a :meth:`send`'s) and is not written yet is
        copied: its owner may reuse that memory now (a side whose queue holds views of its
        owners' memory, ``copy_unsent`` False, calls this when it tells an owner early)."""
        with self._send_lock:
            if self._sent_total < mark and self._out:
                self._out = [bytes(b) for b in self._out]

    def released(self, item: Any) -> None:
        """What was queued with ``after=item`` is written (or copied): ``item()`` unless a
        side says otherwise."""
        item()

    def send_now(self, bufs: Sequence[Buf]) -> int:
        """From a thread that is not the reactor's: write ``bufs`` at once (after what is
        queued), the rest when the socket takes it.  Returns their end, as :meth:`send`."""
        with self._send_lock:
            for b in bufs:
                self._out.append(b)
                self._out_bytes += len(b)
            mark = self._sent_total + self._out_bytes
            self._write()
            return mark

    def flush(self) -> None:
        with self._send_lock:
            self._flush_queued = False
            self._write()

    def _write(self) -> None:
        """Write what is queued (the send lock held); keep and copy what the socket did
        not take; run the ``after`` callbacks."""
        out = self._out
        before = self._sent_total
        while out and not self.closed:
            sliced = len(out) > IOV_MAX     # (one sendmsg takes IOV_MAX buffers at most)
            try:
                sent = self.sock.sendmsg(out[:IOV_MAX] if sliced else out)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as exc:
                self._out = []
                self._out_bytes = 0
                reason = f"send failed: {exc.strerror or exc}"
                if self.reactor is not None:
                    self.reactor.call_soon_threadsafe(lambda: self.on_lost(reason))
                break
            total = self._out_bytes
            self._out_bytes = total - sent
            self._sent_total += sent
            if sent == total:               # all of it (the common case): no walk
                out.clear()
                break
            i = 0
            while i < len(out) and sent >= len(out[i]):
                sent -= len(out[i])
                i += 1
            if i:
                del out[:i]
            if not out:
                break
            if sliced and i == IOV_MAX:     # the whole slice went: the socket has room
                continue
            if sent:
                out[0] = memoryview(out[0])[sent:]
            # The socket is full: copy what is left (it may reference memory that its
            # owner reuses once told, below), unless this side's owners are told only
            # once their bytes are written; and try again shortly.
            if self.copy_unsent:
                self._out = out = [bytes(b) for b in out]
                self._sent_upto = self._sent_total + self._out_bytes
            self._schedule_retry(self._sent_total != before)
            break
        if self._after:
            self._release_after("after send", self._sent_upto
                                if self._sent_upto > self._sent_total else self._sent_total)
        if self._paused or self._out_bytes > self.max_unsent:
            self._pause_if_full()

    def _release_after(self, when: str, upto: int | None = None) -> None:
        """:meth:`released` for every item queued up to stream position ``upto`` (None:
        all of them)."""
        after = self._after
        if not after:
            return
        if upto is None or after[-1][0] <= upto:
            self._after = []
        else:
            n = 0
            while after[n][0] <= upto:
                n += 1
            if not n:
                return
            self._after = after[n:]
            after = after[:n]
        for _mark, item in after:
            try:
                self.released(item)
            except Exception:
                log.exception("%s: release %s failed", self.name, when)

    def _schedule_retry(self, moved: bool = True) -> None:
        """Call :meth:`flush` again soon (see RETRY_FIRST; ``moved``: this write took some
        bytes)."""
        delay = self._retry_delay = RETRY_FIRST if moved else \
            min(2 * self._retry_delay, RETRY_MAX)
        if self._retry is None and self.reactor is not None:
            def retry() -> None:
                self._retry = None
                self.flush()
            if self.reactor.ident == threading.get_ident():
                self._retry = self.reactor.call_later(delay, retry)
            else:
                self.reactor.call_soon_threadsafe(
                    lambda: setattr(self, "_retry", self.reactor.call_later(delay, retry))
                    if self.reactor is not None and self._retry is None else None)

    def _pause_if_full(self) -> None:
        if self._out_bytes > self.max_unsent and not self._paused:
            self._paused = True             # read nothing more until the peer reads
        elif self._paused and self._out_bytes <= self.max_unsent // 2:
            self._paused = False
            if self.reactor is not None:
                self.reactor.call_soon_threadsafe(self.on_readable)

    @property
    def unsent(self) -> int:
        return self._out_bytes

    def close(self) -> None:
        if self.closed:
            return
        self._detach()
        self.closed = True
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        self._out = []
        self._direct = None                 # a view of the memory a transfer was landing in
        self._release_after("at close")
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError as exc:
            if exc.errno not in (errno.ENOTCONN, errno.EBADF):
                log.debug("%s: shutdown: %s", self.name, exc)
        self.sock.close()
