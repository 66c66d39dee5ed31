"""The ``verbs`` provider: pyverbs + rdma_cm on a real RDMA device (RoCE, IB, iWARP, rxe, siw).

pyverbs is imported when the provider is first created, never by ``import blockfabric.rdma``.
Where pyverbs or a device is missing, :class:`VerbsProvider` raises ProviderUnavailable with a
one-line fix, so ``auto`` can fall back to the soft provider.

Private data: rdma_cm hands the receiver the whole private-data field of the CM message, zero
padded (56 B in a connect request, 196 B in an accept, 148 B in a reject on IB/RoCE), so
``CMId.private_data`` is at least as long as what the peer sent, never shorter.
"""

from __future__ import annotations

import ipaddress
import os
import threading
from pathlib import Path

from blockfabric.errors import ProviderUnavailable, RdmaError
from blockfabric.rdma import base
from blockfabric.rdma.base import DeviceInfo
from blockfabric.rdma.verbs import _native
from blockfabric.rdma.verbs.cm import VerbsCMId, VerbsListener, _Channel, _destroy_id
from blockfabric.rdma.verbs.resources import Device

__all__ = ["VerbsProvider"]

SYSFS = Path("/sys/class/infiniband")


class VerbsProvider(base.Provider):
    """pyverbs + rdma_cm.  One instance per process is enough (see get_provider)."""

    name = "verbs"

    def __init__(self) -> None:
        self._pv = _native.load()
        try:
            found = self._pv.device.get_device_list()
        except self._pv.PyverbsError:
            found = []
        if not found:
            raise ProviderUnavailable(_native.DEVICE_HINT)
        if not os.path.exists("/dev/infiniband/rdma_cm"):
            raise ProviderUnavailable("no /dev/infiniband/rdma_cm: modprobe rdma_ucm, "
                                      "or use --provider soft")
        self._names = [d.name.decode() if isinstance(d.name, bytes) else d.name for d in found]
        self._devices: dict[str, Device] = {}
        self._lock = threading.Lock()

    def _device(self, name: str | bytes) -> Device:
        """The shared, reference-counted context of device ``name``."""
        name = name.decode() if isinstance(name, bytes) else name
        with self._lock:
            dev = self._devices.get(name)
            if dev is None:
                dev = self._devices[name] = Device(self._devices, self._lock, name)
            return dev

    def devices(self) -> list[DeviceInfo]:
        return [DeviceInfo(name=n, provider=self.name, node_guid=_read(SYSFS / n / "node_guid"),
                           ports=_ports(n)) for n in self._names]

    def owns_address(self, address: str) -> bool:
        """True when ``address`` is a GID (RoCE: an IP of the device's netdev) of some port.

        rdma_cm binds loopback addresses to any device, so a bind test would claim
        127.0.0.1; the GID table only lists addresses the device really serves.  InfiniBand
        ports (IPoIB addresses are not GIDs) are asked through rdma_cm instead.
        """
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return False
        if ip.is_unspecified:
            return True
        if ip.is_loopback:
            return False
        mapped = ipaddress.IPv6Address(f"::ffff:{ip}") if ip.version == 4 else ip
        infiniband = False
        for dev in self._names:
            for port in _ports(dev):
                if mapped in port["gids"]:
                    return True
                infiniband |= port["link_layer"] == "InfiniBand"
        return infiniband and self._binds(address)

    def _binds(self, address: str) -> bool:
        try:
            listener = VerbsListener(self, address, 0, 1)
        except RdmaError:
            return False
        listener.close()
        return True

    def listen(self, address: str, port: int, backlog: int = 128, *,
               max_pending: int = base.MAX_PENDING_REQUESTS,
               request_timeout: float = base.REQUEST_TIMEOUT) -> VerbsListener:
        """``request_timeout`` does not apply: the kernel's CM receives a request whole and
        times out its own half-done exchanges."""
        return VerbsListener(self, address, port, backlog, max_pending)

    def create_id(self) -> VerbsCMId:
        channel = _Channel()
        try:
            raw = channel.new_id()
        except BaseException:
            channel.release(None)       # no id on it: destroyed now, not by a finalizer
            raise
        try:
            cmid = VerbsCMId(self, channel, raw)
        except BaseException:
            # the id first, then its channel (an id outliving its channel is a use after
            # free in librdmacm); an id that cannot be destroyed keeps the channel
            if _destroy_id(raw, "a new CM id"):
                channel.release(None)
            raise
        channel.default = cmid
        return cmid


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _ports(dev: str) -> list[dict]:
    ports = []
    for pdir in sorted((SYSFS / dev / "ports").glob("*"), key=lambda p: int(p.name)):
        gids, netdevs = [], []
        for g in sorted((pdir / "gids").glob("*"), key=lambda p: int(p.name)):
            text = _read(g)
            if text and int(text.replace(":", ""), 16):
                gids.append(ipaddress.IPv6Address(text))
                netdevs.append(_read(pdir / "gid_attrs" / "ndevs" / g.name))
        ports.append({"port": int(pdir.name), "state": _read(pdir / "state"),
                      "link_layer": _read(pdir / "link_layer"), "gids": gids,
                      "netdevs": sorted({n for n in netdevs if n})})
    return ports
