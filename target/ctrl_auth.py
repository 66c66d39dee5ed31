"""A controller's DH-HMAC-CHAP gate: in-band authentication of each queue (NVMe base
8.3.4, as nvmet), in front of :meth:`Controller.handle` when the host's allow-list entry has a
secret.  A mixin of :class:`~blockfabric.target.controller.Controller`; it imports nothing of
the controller module (the import goes one way: controller -> ctrl_auth)."""

from __future__ import annotations

import logging
from time import monotonic
from typing import TYPE_CHECKING, Callable, Protocol

from blockfabric.fabric.reactor import Timer
from blockfabric.fabric.target_side import Command
from blockfabric.protocol import StatusCode
from blockfabric.protocol import auth as dhchap
from blockfabric.protocol.errors import ProtocolError
from blockfabric.protocol.opcodes import FABRICS_OPCODE, FabricsType

if TYPE_CHECKING:
    from blockfabric.fabric.tcp_target import AnyTargetQueue
    from blockfabric.protocol.controller import ControllerState
    from blockfabric.target.services import Owner, Resources

    class _Rest(Protocol):
        """What this half uses of the rest of its Controller (controller.py): mypy checks
        that the composed Controller has it."""

        hostnqn: str

        @property
        def name(self) -> str: ...
        @property
        def subnqn(self) -> str: ...
        @property
        def state(self) -> ControllerState: ...
        def handle(self, cmd: Command) -> None: ...
        def _count_error(self, cmd: Command) -> None: ...
else:
    _Rest = object

# The controller's log, whichever of its modules a line comes from (no name changes).
log = logging.getLogger("blockfabric.target.controller")


#: Largest Authentication Send/Receive transfer taken (the Linux host uses 4 KiB; a Reply
#: with ffdhe8192 is 16 + 2 x 64 + 1024 bytes).
AUTH_MAX_TRANSFER = 16 * 1024


def no_auth(cmd: Command) -> ProtocolError:
    """Authentication Send/Receive from a host that is not asked to authenticate: what
    nvmet built without authentication answers (an unknown capsule type)."""
    return ProtocolError(f"fabrics command {cmd.sqe.fctype:#x}: this host has no "
                         "DH-HMAC-CHAP secret here", StatusCode.INVALID_OPCODE)


class AuthGate(_Rest):
    """The authentication half of a controller (see :class:`Controller` for its state)."""

    # Of the controller's state, what this half reads and writes.
    res: Resources
    owner: Owner
    queues: dict[int, AnyTargetQueue]
    auth_policy: dhchap.AuthPolicy | None
    auth: dict[int, dhchap.TargetAuth]
    auth_timers: dict[int, Timer]
    _auth_reported: set[dhchap.TargetAuth]
    auth_failures: int
    dead: bool
    last_activity: float

    def queue_handler(self, qid: int) -> Callable[[Command], None]:
        """What runs the commands of queue ``qid``: :meth:`handle` itself when the host does
        not authenticate (so that path costs nothing more), else a gate in front of it."""
        if self.auth_policy is None:
            return self.handle
        state = dhchap.TargetAuth(self.auth_policy, self.hostnqn, self.subnqn)
        self.auth[qid] = state
        self._arm_auth_timer(self.queues[qid], state)
        return lambda cmd: self._gate(cmd, state)

    def _arm_auth_timer(self, queue: AnyTargetQueue, auth: dhchap.TargetAuth) -> None:
        """Within limits.auth_timeout the queue is authenticated (its Connect just now), or
        its failed exchange answered (a failure): else the queue ends (the admin queue: the
        controller).  nvmet resets an abandoned transaction after KATO (120 s without);
        here an unauthenticated queue holds a connection slot and may keep its controller
        alive with Fabrics commands, so it ends."""
        timeout = self.res.limits.auth_timeout
        old = self.auth_timers.pop(queue.qid, None)
        if old is not None:
            old.cancel()
        self.auth_timers[queue.qid] = self.res.reactor.call_later(
            timeout, lambda: self._auth_expired(queue, auth, timeout))

    def _auth_expired(self, queue: AnyTargetQueue, auth: dhchap.TargetAuth, timeout: int) -> None:
        qid = queue.qid
        if self.auth.get(qid) is not auth:      # the queue is gone, or connected again
            return
        self.auth_timers.pop(qid, None)
        if self.dead or queue.closed or auth.authenticated:
            return
        if not auth.failed:
            auth.reason = (f"not authenticated within {timeout} s of the Connect "
                           "(limits.auth_timeout)")
            auth.explanation = dhchap.Explanation.FAILED
        self._auth_failed(queue, auth)
        self._end_auth(queue, f"authentication timed out on qid {qid}")

    def _auth_failed(self, queue: AnyTargetQueue, auth: dhchap.TargetAuth) -> None:
        """A queue's exchange failed: logged (its peer, the host NQN) and counted once per
        exchange, the moment it is known; the queue ends once the host has had the answer
        (Failure1), or after limits.auth_timeout if it never asks for it."""
        if auth in self._auth_reported:
            return
        self._auth_reported.add(auth)
        self.auth_failures += 1
        self.owner.auth_failed(self, queue, auth)  # type: ignore[arg-type]  # (a Controller)
        if not auth.fatal:
            self._arm_auth_timer(queue, auth)

    def _end_auth(self, queue: AnyTargetQueue, reason: str) -> None:
        """After a failed exchange: the admin queue takes the controller with it (as
        nvmet); an I/O queue goes alone, so that whoever joins a controller with a queue it
        cannot authenticate does not take down the host that owns it."""
        if queue.qid == 0:
            self.owner.destroy_controller(self, reason)  # type: ignore[arg-type]  # (a Controller)
        else:
            self.owner.end_queue(queue, reason)

    def _gate(self, cmd: Command, auth: dhchap.TargetAuth) -> None:
        """Authentication Send/Receive go to the queue's transaction; before it succeeded,
        everything else but Fabrics commands is AUTH_REQUIRED | DNR (nvmet_parse_admin_cmd,
        nvmet_parse_io_cmd)."""
        if cmd.opcode == FABRICS_OPCODE:
            fctype = cmd.sqe.fctype
            if fctype == FabricsType.AUTH_SEND or fctype == FabricsType.AUTH_RECEIVE:
                if self.owner.draining:
                    return
                self.last_activity = monotonic()
                try:
                    self._auth_command(cmd, auth)
                except ProtocolError as exc:
                    self._count_error(cmd)
                    log.debug("%s qid=%d: cid %d authentication command: %s", self.name,
                              cmd.queue.qid, cmd.cid, exc)
                    cmd.respond(exc.status, dnr=exc.dnr, result=exc.result or 0)
                return
        elif not auth.authenticated:
            self._count_error(cmd)
            cmd.respond(StatusCode.AUTH_REQUIRED, dnr=True)
            return
        self.handle(cmd)

    @staticmethod
    def _auth_fields(secp: int, spsp0: int, spsp1: int, length: int, what: str) -> None:
        if secp != dhchap.SECP_DHCHAP or spsp0 != dhchap.SPSP_DHCHAP or spsp1 != dhchap.SPSP_DHCHAP:
            raise ProtocolError(f"authentication SECP {secp:#x} SPSP {spsp0:#x}/{spsp1:#x}: "
                                "only DH-HMAC-CHAP (0xe9, 1, 1)", StatusCode.INVALID_FIELD)
        if not 0 < length <= AUTH_MAX_TRANSFER:
            raise ProtocolError(f"authentication {what} {length}, not 1..{AUTH_MAX_TRANSFER}",
                                StatusCode.INVALID_FIELD)

    def _auth_command(self, cmd: Command, auth: dhchap.TargetAuth) -> None:
        self.state.admit(cmd.sqe, cmd.queue.qid)
        if cmd.sqe.fctype == FabricsType.AUTH_SEND:
            send = dhchap.AuthSend.from_sqe(cmd.sqe)
            self._auth_fields(send.secp, send.spsp0, send.spsp1, send.tl, "TL")
            if cmd.data_length != send.tl:
                raise ProtocolError(f"SGL length {cmd.data_length}, TL {send.tl}",
                                    StatusCode.SGL_DATA_LENGTH_INVALID)
            view, sge, release = self.res.control_buffer(cmd.queue, send.tl)
            cmd.on_released = release
            cmd.fetch(view, sge, lambda c: self._auth_sent(c, auth, bytes(view[:send.tl])))
            return
        receive = dhchap.AuthReceive.from_sqe(cmd.sqe)
        self._auth_fields(receive.secp, receive.spsp0, receive.spsp1, receive.al, "AL")
        if cmd.data_length != receive.al:
            raise ProtocolError(f"SGL length {cmd.data_length}, AL {receive.al}",
                                StatusCode.SGL_DATA_LENGTH_INVALID)
        try:
            message = auth.receive(receive.al)
        except dhchap.AuthError as exc:
            raise ProtocolError(str(exc), StatusCode.INVALID_FIELD) from exc
        if auth.failed:
            self._auth_failed(cmd.queue, auth)
        view, sge, release = self.res.control_buffer(cmd.queue, len(message))
        view[:len(message)] = message
        cmd.on_released = self._auth_release(cmd, auth, release)
        cmd.respond(data=(sge,))

    def _auth_sent(self, cmd: Command, auth: dhchap.TargetAuth, message: bytes) -> None:
        was = auth.authenticated
        auth.send(message)
        if auth.failed:
            self._auth_failed(cmd.queue, auth)
        elif auth.authenticated and not was:
            timer = self.auth_timers.pop(cmd.queue.qid, None)
            if timer is not None:
                timer.cancel()
            both = message[1:2] == bytes([dhchap.AuthMsg.SUCCESS2])
            log.info("%s qid=%d: host authenticated (hash %s, DH group %s)%s", self.name,
                     cmd.queue.qid, dhchap.HASH_NAMES.get(auth.hash_id, auth.hash_id),
                     dhchap.DHGROUP_NAMES.get(auth.dhgroup, auth.dhgroup),
                     "; it authenticated the controller too" if both else "")
        cmd.on_released = self._auth_release(cmd, auth, cmd.on_released)
        cmd.respond()

    def _auth_release(self, cmd: Command, auth: dhchap.TargetAuth,
                      release: Callable[[Command], None] | None
                      ) -> Callable[[Command], None] | None:
        """What runs once the answer has been sent: after a failure, the end of the queue
        (:meth:`_end_auth`; nvmet_ctrl_fatal_error after Failure1 or a message out of
        sequence).  Set before the answer is posted: a provider may complete the send at
        once."""
        if not auth.fatal or self.dead:
            return release
        queue = cmd.queue
        reason = f"authentication failed on qid {queue.qid}"

        def released(c: Command) -> None:
            if release is not None:
                release(c)
            self.res.reactor.call_later(0, lambda: self._end_auth(queue, reason))

        return released
