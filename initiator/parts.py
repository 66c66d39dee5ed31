"""What the parts of the host's :class:`~blockfabric.initiator.host.Controller` see of the
whole: its state and the methods one part calls on another, as one Protocol.

:class:`Controller` is composed of :class:`~.connection.QueueSetup`, :class:`~.events.Events`,
:class:`~.io.IoPath` and :class:`~.recovery.Recovery` (mixins: each is written against the
composed controller).  For the type checker only, each part derives from
:class:`ControllerParts` (at run time from ``object``, as before): mypy then checks every part
against this one description, and that the composed controller has all of it (it cannot be
instantiated otherwise).  Nothing here runs; the state is set in ``Controller.__init__``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Protocol

if TYPE_CHECKING:
    import concurrent.futures
    import itertools
    import threading
    from collections.abc import Iterable

    from blockfabric.fabric.host_side import HostQueue
    from blockfabric.fabric.reactor import Reactor, Timer
    from blockfabric.initiator.arena import Arena
    from blockfabric.initiator.host import ConnectOptions, Controller, _Tcp
    from blockfabric.initiator.io import HeldCommand, IoCommand, SqeCommand
    from blockfabric.initiator.namespace import HostNamespace
    from blockfabric.initiator.recovery import CtrlEvent, CtrlState, RecoveryStats
    from blockfabric.protocol import CQE, SQE, IdentifyCNS, IdentifyController, KeyedSGL
    from blockfabric.protocol.auth import Secret
    from blockfabric.rdma import PD, Provider


class _State:
    """The composed controller's state (set in Controller.__init__)."""

    _share: Controller | None
    opts: ConnectOptions
    hostnqn: str
    hostid: bytes
    dhchap_secret: Secret | None
    dhchap_ctrl_secret: Secret | None
    _transactions: itertools.count[int]
    authenticated: dict[int, str]
    connect_result: int
    provider: Provider | _Tcp
    reactor: Reactor
    admin: HostQueue | None
    io_queues: list[HostQueue]
    io_share: tuple[int, int]
    io_queues_granted: int
    io_depth: int
    namespaces: dict[int, HostNamespace]
    cntlid: int
    identify: IdentifyController | None
    arena: Arena | None
    pd: PD | None
    _rr: itertools.count[int]
    _ka_timer: Timer | None
    _closed: bool
    max_transfer: int
    inline_size: int
    namespace_listeners: list[Callable[[Controller, set[int]], None]]
    state_listeners: list[Callable[[Controller], None]]
    ana_log: tuple[int, list[Any]] | None
    ana_listeners: list[Callable[[Controller, tuple[int, list[Any]]], None]]
    _events: concurrent.futures.ThreadPoolExecutor | None
    _rescan_all: bool
    paths: list[tuple[str, int]]
    path_index: int
    state: CtrlState
    recovery: RecoveryStats
    _state_lock: threading.Lock
    _held: list[HeldCommand]
    _gen: int
    _loss_deadline: float | None
    _wake: threading.Event
    _recovery_thread: threading.Thread | None
    _ka_sent: float | None
    _closing: bool


class _Methods(Protocol):
    """Its methods, one part's used by another (abstract here: mypy checks that the
    composed controller has each)."""

    @property
    def path(self) -> tuple[str, int]: ...
    def close(self) -> None: ...

    # connection
    def _establish(self) -> None: ...
    # events
    def rescan(self, nsids: Iterable[int] | None = None) -> set[int]: ...
    def _start_events(self) -> None: ...
    def _identify(self, cns: IdentifyCNS, nsid: int = 0) -> bytes: ...
    def property_get(self, offset: int, size: int, timeout: float | None = None) -> int: ...
    def property_set(self, offset: int, value: int, timeout: float | None = None) -> None: ...
    # io
    def io_queue(self) -> HostQueue: ...
    def submit(self, queue: HostQueue, sqe: SQE, callback: Any, *, data_out: Any = None,
               data_in: int = 0, inline: bool = False, sgl: KeyedSGL | None = None
               ) -> None: ...
    def wait(self, queue: HostQueue, sqe: SQE, what: str, *, data_out: Any = None,
             data_in: int = 0, inline: bool = False, timeout: float | None = None
             ) -> tuple[CQE, bytes | None]: ...
    def _path_status(self, cmd: IoCommand | SqeCommand, word: int, result: int) -> None: ...
    # recovery
    def _move(self, event: CtrlEvent) -> bool: ...
    def _dispatch(self, req: HeldCommand) -> None: ...
    def _hold(self, req: HeldCommand, error: BaseException) -> None: ...
    def _schedule_keep_alive(self, kato_ms: int) -> None: ...


class ControllerParts(_State, _Methods):
    """The composed controller, as its parts use it (see the module text)."""
