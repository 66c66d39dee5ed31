"""Runtime namespaces and subsystems: configuration plus an open backend.

A namespace's volume is exposed through registered memory where it *is* memory (the
ramdisk): it is registered once per protection domain, for local access only (the target
issues every RDMA READ and WRITE itself; no peer ever gets an rkey into target memory).
"""

from __future__ import annotations

import logging
import uuid
from typing import TYPE_CHECKING, Callable

from blockfabric.rdma import MR, PD, Access
from blockfabric.target import config as cfg
from blockfabric.target import resvctl
from blockfabric.target.backends import Backend, open_backend
from blockfabric.target.metrics import IoStats

if TYPE_CHECKING:
    from blockfabric.target.reservations import State
    from blockfabric.target.resvstore import Store

log = logging.getLogger(__name__)


class Namespace:
    """One exported namespace: its configuration, backend and registrations."""

    def __init__(self, conf: cfg.Namespace, backend: Backend | None = None,
                 resv: bool = True) -> None:
        """``backend``: the volume already open (a poll-group worker's view of a shared
        ramdisk); ``resv`` False: the reservation state is not read from its store but
        given (a worker's comes from its coordinator, see target.worker)."""
        self.conf = conf
        self.nsid = conf.nsid
        self.block_size = conf.block_size
        self.read_only = conf.read_only
        self.backend: Backend = open_backend(conf) if backend is None else backend
        self.nblocks = self.backend.size // self.block_size
        self.uuid = uuid.UUID(conf.uuid).bytes if conf.uuid else bytes(16)
        self.nguid = bytes.fromhex(conf.nguid) if conf.nguid else bytes(16)
        self._mrs: dict[int, tuple[PD, MR]] = {}
        # Zero-copy only where the volume is memory; others go through bounce buffers.
        self.memory = self.backend.memory
        self.stats = IoStats()
        # While paused (a resize waits for in-flight I/O to finish), new commands are held
        # here and re-dispatched afterwards.
        self.paused = False
        self.held: list[Callable[[], None]] = []
        # ANA (a gateway group: blockfabric.target.ana sets them): the group, and 0 when
        # this path may serve I/O, else the path-related status the I/O is answered with.
        self.ana_group = 0
        self.ana_status = 0
        # Reservations (blockfabric.target.resvctl): the state this daemon knows (None:
        # unreadable) and whether nothing is reserved (the I/O path's one test).
        self.resv_state: State | None = None
        self.resv_store: Store      # set by resvctl.attach, just below
        self.resv_bound = False     # resvctl.bind: its store's watch is set up
        self.resv_open = True
        if not resv:
            return
        try:
            resvctl.attach(self)
        except OSError:
            self.backend.close()
            raise

    @property
    def size(self) -> int:
        return self.nblocks * self.block_size

    def mr(self, pd: PD) -> MR | None:
        """The volume's memory registered in ``pd`` (LOCAL_WRITE only), or None."""
        if self.memory is None:
            return None
        entry = self._mrs.get(id(pd))
        if entry is None:
            entry = (pd, pd.reg_mr(self.memory, Access.LOCAL_WRITE))
            self._mrs[id(pd)] = entry
            self.backend.pinned = True      # see RamdiskBackend._write_zeroes
        return entry[1]

    def resize(self, conf: cfg.Namespace) -> None:
        """Take the new size of ``conf``.  Only with no I/O in flight: the memory regions
        over the old mapping are dropped (the mapping may move) and registered again on
        first use."""
        self._deregister()
        self.memory = None
        try:
            self.backend.resize(conf.size)  # type: ignore[arg-type]  # None only for rbd, whose caller sets the image's
        finally:
            self.memory = self.backend.memory
        self.conf = conf
        self.nblocks = self.backend.size // self.block_size

    def _deregister(self) -> None:
        for _pd, mr in self._mrs.values():
            try:
                mr.close()
            except Exception as exc:  # teardown continues
                log.debug("ns %d: deregistering: %s", self.nsid, exc)
        self._mrs.clear()
        self.backend.pinned = False

    def close(self) -> None:
        self._deregister()
        self.memory = None
        self.resv_store.close()
        self.backend.close()


class Subsystem:
    """One NVM subsystem at runtime."""

    def __init__(self, conf: cfg.Subsystem) -> None:
        self.conf = conf
        self.nqn = conf.nqn
        self.namespaces: dict[int, Namespace] = {}
        self.retired = IoStats()    # the history of namespaces removed by a reload
        try:
            for ns_conf in conf.namespaces:
                self.namespaces[ns_conf.nsid] = Namespace(ns_conf)
        except BaseException:
            self.close()
            raise

    @property
    def serial(self) -> str:
        return self.conf.serial or ""

    @property
    def model(self) -> str:
        return self.conf.model

    def allows(self, hostnqn: str) -> bool:
        return self.conf.allows(hostnqn)

    def stats(self) -> IoStats:
        """The subsystem's totals: its namespaces plus those removed since start."""
        total = self.retired.copy()
        for ns in self.namespaces.values():
            total.add(ns.stats)
            total.inflight += ns.stats.inflight
        return total

    def close(self) -> None:
        for ns in self.namespaces.values():
            ns.close()
        self.namespaces.clear()
