"""A host library controller that attacks from another source address (127.0.0.2, or on
verbs the lab's second address: so that the bystander's per-address limits and back-offs are
not its own) and sends Connects and
authentication messages by hand."""

from __future__ import annotations

from blockfabric.initiator.host import ADMIN_DEPTH, ConnectOptions, Controller, NvmeError
from blockfabric.protocol import ConnectCommand, ConnectData

from e2e.conftest import addr_of, peer_addr, via

ATTACKER = peer_addr(2)


class _FromSource:
    """The controller's provider, with every connection made from ``source``."""

    def __init__(self, provider, source: str) -> None:
        self._provider, self._source = provider, source

    def __getattr__(self, name: str):
        return getattr(self._provider, name)

    def create_id(self):
        cmid = self._provider.create_id()
        resolve = cmid.resolve
        source = self._source
        cmid.resolve = lambda address, port, timeout=5.0, source_=None: resolve(
            address, port, timeout, source=source)
        return cmid


def attacker(port: int, subnqn: str, hostnqn: str, *, source: str = ATTACKER,
             start: bool = True, **options) -> Controller:
    """A controller object whose queues come from ``source``, nothing connected (its
    reactor started unless ``start`` is false: then call its ``connect()``); ``options`` as
    ConnectOptions (e.g. dhchap_secret)."""
    options.setdefault("ctrl_loss_tmo", 0)
    ctrl = Controller(ConnectOptions(addr_of(), subnqn, port, hostnqn=hostnqn,
                                     **via(), **options))
    ctrl.provider = _FromSource(ctrl.provider, source)
    if start:
        ctrl.reactor.start()
    return ctrl


def admin_queue(ctrl: Controller):
    queue = ctrl.open_queue(0, ADMIN_DEPTH)
    ctrl.admin = queue
    return queue


def raw_connect(ctrl: Controller, queue, data: ConnectData | bytes, *, qid: int = 0,
                kato: int = 0, sqsize: int = ADMIN_DEPTH - 1) -> tuple[int, bool, int]:
    """A Connect with these data (bytes: sent as they are) on ``queue``: the status, DNR
    and result of its answer."""
    raw = data if isinstance(data, bytes) else data.pack()
    sqe = ConnectCommand(recfmt=0, qid=qid, sqsize=sqsize, kato=kato).to_sqe()
    try:
        cqe, _ = ctrl.wait(queue, sqe, "Connect", data_out=raw)
    except NvmeError as exc:
        return int(exc.status), exc.dnr, exc.result & 0xFFFFFFFF
    return 0, cqe.dnr, cqe.result & 0xFFFFFFFF
