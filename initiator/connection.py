"""Setting a controller up on a path: queue connections, Fabrics Connect, DH-HMAC-CHAP, CC.EN."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from blockfabric.initiator.arena import Arena
from blockfabric.initiator.errors import AuthenticationFailed, NvmeError
from blockfabric.initiator.recovery import CtrlEvent

from blockfabric.errors import ConnectionRejected, QueueDead
from blockfabric.fabric.host_side import HostQueue
from blockfabric.fabric.tcp import local_pd
from blockfabric.fabric.tcp_host import TcpHostQueue, open_connection
from blockfabric.protocol import (CC, CSTS, DISCOVERY_NQN, DYNAMIC_CNTLID, CMAccept,
                                  CMConnectRequest, CMReject, ConnectCommand, ConnectData,
                                  IdentifyCNS, IdentifyController, NumberOfQueues, Property,
                                  ProtocolError, SetFeatures)
from blockfabric.protocol.auth import (CONNECT_AUTHREQ_ASCR, CONNECT_AUTHREQ_ATR, DHGROUP_NAMES,
                                       HASH_NAMES, AuthError, AuthReceive, AuthSend, Secret,
                                       host_authenticate)
from blockfabric.protocol.opcodes import FeatureId
from blockfabric.rdma import PD, CMId

if TYPE_CHECKING:
    from blockfabric.initiator.host import ConnectOptions, Controller

log = logging.getLogger(__name__)

#: In-capsule data a command may carry here at most, whatever the target's IOCCSZ allows
#: (16 KiB: the targets of this project, SPDK and nvmet offer 4-16 KiB)
MAX_INLINE_DATA = 16 << 10

if TYPE_CHECKING:
    from blockfabric.initiator.parts import ControllerParts
else:
    ControllerParts = object    # (the parts' description, for the type checker: parts.py)

ADMIN_DEPTH = 32
CAPSULE_CONNECT_DATA = 1024


class QueueSetup(ControllerParts):
    """The controller's set-up: its queues' connections, Fabrics Connect, in-band
    authentication, enabling, and the I/O queues; all of it again on each reconnect."""

    def open_queue(self, qid: int, depth: int) -> HostQueue:
        """Set up the RDMA connection of queue ``qid`` (CM private data exchanged, receives
        posted, serviced by this controller's reactor), not yet bound by a Fabrics Connect."""
        opts = self.opts
        traddr, trsvcid = self.path
        if opts.transport == "tcp":
            return self._open_tcp_queue(qid, depth)
        cmid: CMId = self.provider.create_id()  # type: ignore[union-attr]  # (RDMA: a Provider)
        try:
            cmid.resolve(traddr, trsvcid, timeout=opts.connect_timeout)
            if self.pd is None:
                self.pd, self.arena = (self._share or self)._memory("rdma", cmid.context)
            inline = self.inline_size if qid else 0
            queue = HostQueue(cmid, self.pd, qid=qid, depth=depth, inline_size=inline,
                              name=f"{traddr}:{trsvcid} q{qid}")
        except BaseException:
            cmid.close()
            raise
        try:
            queue.post_all_receives()
            request = CMConnectRequest(recfmt=0, qid=qid, hrqsize=depth, hsqsize=depth - 1,
                                       cntlid=self.cntlid if qid else 0)
            try:
                accept = cmid.connect(request.pack(), timeout=opts.connect_timeout)
            except ConnectionRejected as exc:
                where = f"{traddr}:{trsvcid}"
                # no NVMe-oF reject data: nothing, or (rdma_cm pads private data with zeros
                # to its whole field) only zeros, as rxe's reject of a port nobody listens on
                if not any(exc.private_data or b""):
                    # the peer's CM refused, not a target: the provider says why
                    raise ConnectionRefusedError(
                        f"connection to {where} refused ({_cause(exc)}): is a target "
                        f"listening there, with provider {self.provider.name}?") from exc
                raise ConnectionRefusedError(f"{where}: " + _reject_text(exc.private_data,
                                                                          qid)) from exc
            try:
                CMAccept.unpack_from(accept)
            except ProtocolError as exc:
                raise ConnectionError(f"malformed CM accept from the target: {exc}") from exc
        except BaseException:
            queue.close()
            raise
        queue.attach(self.reactor)
        return queue

    def _memory(self, transport: str, context: Any = None) -> tuple[PD, Arena]:
        """The protection domain and arena a queue of ``transport`` uses: this controller's,
        made on first use (RDMA: on the device ``context`` of the queue's CM id; TCP: a local
        one).  A multipath controller shares its own with its paths, whatever their
        transports."""
        if self.pd is None:
            self.pd = context.alloc_pd() if transport == "rdma" else local_pd()
            self.arena = Arena(self.pd, self.opts.arena_size)
        return self.pd, self.arena  # type: ignore[return-value]  # (made with the PD)

    def _open_tcp_queue(self, qid: int, depth: int) -> HostQueue:
        """The NVMe/TCP connection of queue ``qid`` (ICReq/ICResp done), attached."""
        opts = self.opts
        traddr, trsvcid = self.path
        if self.pd is None:
            self.pd, self.arena = (self._share or self)._memory("tcp")
        sock, resp = open_connection(traddr, trsvcid, hdgst=opts.hdr_digest,
                                     ddgst=opts.data_digest, timeout=opts.connect_timeout,
                                     hpda=opts.hpda)
        queue = TcpHostQueue(sock, self.pd, resp,  # type: ignore[arg-type]  # (TCP: a local_pd)
                             qid=qid, depth=depth,
                             inline_size=self.inline_size if qid else 0,
                             name=f"{traddr}:{trsvcid} q{qid} tcp", hpda=opts.hpda)
        try:
            queue.attach(self.reactor)
        except BaseException:
            queue.close()
            raise
        return queue

    def fabrics_connect(self, queue: HostQueue, qid: int, sqsize: int, kato_ms: int, *,
                        authenticate: bool = True) -> int:
        """Send the Fabrics Connect for ``queue``, and authenticate the queue when the
        controller asks for it (ATR), as the Linux host does; returns the controller id.
        ``authenticate=False`` leaves that to the caller (tests)."""
        data = ConnectData(hostid=self.hostid, cntlid=DYNAMIC_CNTLID if qid == 0 else
                           self.cntlid, subnqn=self.opts.subnqn, hostnqn=self.hostnqn).pack()
        disable = self.opts.disable_sqflow
        if disable is None:
            disable = self.opts.transport == "tcp"
        cattr = 4 if disable else 0
        sqe = ConnectCommand(recfmt=0, qid=qid, sqsize=sqsize, cattr=cattr,
                             kato=kato_ms).to_sqe()
        inline = qid != 0 and queue.inline_size >= CAPSULE_CONNECT_DATA
        cqe, _ = self.wait(queue, sqe, f"Connect (queue {qid})", data_out=data,
                           inline=inline)
        self.connect_result = result = cqe.result & 0xFFFFFFFF
        if authenticate and result & (CONNECT_AUTHREQ_ATR | CONNECT_AUTHREQ_ASCR):
            self._authenticate(queue, qid, result)
        return result & 0xFFFF

    def _authenticate(self, queue: HostQueue, qid: int, result: int) -> None:
        subnqn = self.opts.subnqn
        if result & CONNECT_AUTHREQ_ASCR:
            raise AuthenticationFailed(f"{subnqn} requires a secure channel (ASCR): not "
                                       "supported")
        if self.dhchap_secret is None:
            raise AuthenticationFailed(
                f"{subnqn} requires host {self.hostnqn} to authenticate: give its "
                "DH-HMAC-CHAP secret (--dhchap-secret, or dhchap_secret in the initiator "
                "configuration)")
        try:
            res = host_authenticate(
                lambda msg: self.auth_send(queue, msg),
                lambda al: self.auth_receive(queue, al),
                t_id=next(self._transactions) & 0xFFFF, hostnqn=self.hostnqn, subnqn=subnqn,
                secret=self.dhchap_secret, ctrl_secret=self.dhchap_ctrl_secret)
        except AuthError as exc:
            raise AuthenticationFailed(f"queue {qid}: DH-HMAC-CHAP authentication with "
                                       f"{subnqn} as {self.hostnqn} failed: {exc}") from exc
        except NvmeError as exc:
            raise AuthenticationFailed(f"queue {qid}: DH-HMAC-CHAP authentication with "
                                       f"{subnqn} failed: {exc}") from exc
        except (QueueDead, TimeoutError) as exc:
            # Linux nvmet ends the controller as it sends Failure1, and the end may overtake
            # the message: a dropped queue in mid-exchange is most likely a refusal
            raise AuthenticationFailed(
                f"queue {qid}: DH-HMAC-CHAP authentication with {subnqn} as {self.hostnqn} "
                f"failed: the controller ended the exchange without an answer ({exc}); a "
                "controller does that when it does not accept the host's response: check "
                "the secret") from exc
        how = (f"hmac({HASH_NAMES.get(res.hash_id, res.hash_id)}), "
               f"{DHGROUP_NAMES.get(res.dhgroup, res.dhgroup)}"
               + (", controller authenticated" if res.bidirectional else ""))
        self.authenticated[qid] = how
        log.log(logging.INFO if qid == 0 else logging.DEBUG, "qid %d: authenticated (%s)",
                qid, how)

    def auth_send(self, queue: HostQueue, message: bytes) -> None:
        """Authentication Send (DH-HMAC-CHAP) of ``message``."""
        self.wait(queue, AuthSend(tl=len(message)).to_sqe(), "Authentication Send",
                  data_out=message)

    def auth_receive(self, queue: HostQueue, al: int) -> bytes:
        """Authentication Receive of ``al`` bytes: the controller's next message."""
        _, data = self.wait(queue, AuthReceive(al=al).to_sqe(), "Authentication Receive",
                            data_in=al)
        return data  # type: ignore[return-value]  # (data_in: bytes)

    def connect(self) -> Controller:
        self.reactor.start()
        try:
            self._establish()
        except BaseException:
            self.close()
            raise
        with self._state_lock:
            self._move(CtrlEvent.CONNECTED)
        return self  # type: ignore[return-value]  # (self: the composed Controller)

    def _establish(self) -> None:
        """Everything ``nvme connect`` does, on the current path; also each reconnect."""
        opts = self.opts
        with self._state_lock:
            self._gen += 1          # what the lost connection left behind is stale now
        self.admin = self.open_queue(0, ADMIN_DEPTH)
        kato_ms = int(opts.keep_alive_tmo * 1000)
        if opts.subnqn == DISCOVERY_NQN:
            kato_ms = 0
        self.cntlid = self.fabrics_connect(self.admin, 0, ADMIN_DEPTH - 1, kato_ms)
        self._enable()
        self.identify = IdentifyController.unpack_from(self._identify(IdentifyCNS.CONTROLLER))
        if self.identify.cntlid != self.cntlid:
            log.warning("Identify cntlid %d differs from Connect's %d",
                        self.identify.cntlid, self.cntlid)
        if self.identify.mdts:
            self.max_transfer = min(4096 << self.identify.mdts, 8 << 20)
        else:
            self.max_transfer = 8 << 20
        # (capped: each command slot of every I/O queue keeps a buffer this large, and
        # IOCCSZ is the target's to say, up to 64 GiB)
        self.inline_size = min(max(0, self.identify.ioccsz * 16 - 64), MAX_INLINE_DATA)
        if kato_ms and opts.send_keep_alive:
            self._schedule_keep_alive(kato_ms)
        if opts.subnqn != DISCOVERY_NQN:
            self._setup_io(opts)
            self._start_events()

    def _enable(self) -> None:
        cap = self.property_get(Property.CAP, 8)
        cc = CC(en=True, css=0, mps=0, ams=0, shn=0, iosqes=6, iocqes=4)
        self.property_set(Property.CC, cc.to_int())
        deadline = time.monotonic() + max(0.5, ((cap >> 24) & 0xFF) * 0.5)
        while True:
            csts = CSTS.from_int(self.property_get(Property.CSTS, 4))
            if csts.cfs:
                raise ConnectionError("controller fatal status while enabling")
            if csts.rdy:
                return
            if time.monotonic() > deadline:
                raise TimeoutError("controller did not become ready")
            time.sleep(0.01)

    def _setup_io(self, opts: ConnectOptions) -> None:
        want = max(1, opts.nr_io_queues)
        cqe, _ = self.wait(self.admin, SetFeatures(  # type: ignore[arg-type]  # (connected)
            fid=FeatureId.NUM_QUEUES, value=NumberOfQueues(nsqr=want - 1,
                                                           ncqr=want - 1).to_int()).to_sqe(),
            "Set Features (number of queues)")
        granted = NumberOfQueues.from_int(cqe.result & 0xFFFFFFFF)
        count = min(want, granted.nsqr + 1, granted.ncqr + 1)
        depth = min(opts.queue_size,
                    (self.identify.maxcmd  # type: ignore[union-attr]  # (_establish read it)
                     or opts.queue_size))
        self.io_queues_granted, self.io_depth = count, depth
        for qid in share_qids(count, *self.io_share):
            queue = self.open_queue(qid, depth)
            self.io_queues.append(queue)
            self.fabrics_connect(queue, qid, depth - 1, 0)
        self.rescan()


def share_qids(count: int, index: int, shares: int) -> list[int]:
    """The I/O queue ids ``1..count`` split in ``shares`` contiguous runs as even as can
    be (the first ones one longer): run ``index``.  One process's share of one controller's
    queues (the mount's FUSE workers, docs/fuse.md)."""
    if count < shares:
        raise ValueError(f"the controller granted {count} I/O queue(s) and {shares} processes "
                         "need one each: lower --fuse-workers, or raise the target's "
                         "max_io_queues")
    size, extra = divmod(count, shares)
    start = 1 + index * size + min(index, extra)
    return list(range(start, start + size + (1 if index < extra else 0)))


def _secret(text: str | None, name: str) -> Secret | None:
    if text is None:
        return None
    try:
        return Secret.parse(text)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None


def _cause(exc: Exception) -> str:
    """A provider's error without the address it starts with (the caller names it)."""
    return str(exc).rsplit(": ", 1)[-1]


def _reject_text(private: bytes, qid: int) -> str:
    try:
        rej = CMReject.unpack_from(private)
        reason = rej.reason.name if rej.reason else str(rej.sts)
    except ProtocolError:
        reason = f"unrecognised reject data {private[:8].hex()}"
    return f"target rejected queue {qid}: {reason}"
