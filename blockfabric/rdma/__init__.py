"""The RDMA layer: one verbs interface (``base``) and its providers.

``soft``  -- a software RDMA NIC over framed TCP (the embedded default, works anywhere).
``verbs`` -- pyverbs + rdma_cm on a real RDMA device (RoCE, InfiniBand, iWARP, rxe, siw).

Use :func:`get_provider` with ``"soft"``, ``"verbs"`` or ``"auto"``: auto picks verbs when an
RDMA device owns the address (and pyverbs imports), else soft, and logs the choice.
Providers are imported lazily, so importing this package loads neither pyverbs nor sockets.
"""

from __future__ import annotations

import logging
import threading

from blockfabric.errors import ProviderUnavailable
from blockfabric.rdma.base import (  # noqa: F401  (the public interface)
    CONNECTION_ENDED, CQ, MR, PD, QP, SGE, WC, Access, CMEvent, CMEventType, CMId, Context,
    DeviceInfo, Listener, Provider, QPCap, QPState, RecvWR, SendFlags, SendWR, WcFlags,
    WcOpcode, WcStatus, WrOpcode)

log = logging.getLogger(__name__)

PROVIDERS = ("soft", "verbs")
_instances: dict[str, Provider] = {}
_instances_lock = threading.Lock()


def get_provider(name: str = "auto", address: str | None = None) -> Provider:
    """Return the provider called ``name`` (one instance per process and name).

    ``auto`` chooses ``verbs`` when pyverbs is importable and an RDMA device owns
    ``address``, otherwise ``soft``; the choice is logged.
    """
    if name == "auto":
        chosen = "soft"
        reason = "no RDMA device owns the address"
        try:
            verbs = get_provider("verbs")
        except ProviderUnavailable as exc:
            reason = str(exc)
        else:
            if address is None or verbs.owns_address(address):
                chosen = "verbs"
                reason = f"an RDMA device owns {address}"
        log.info("provider auto -> %s (%s)", chosen, reason)
        return get_provider(chosen)
    if name not in PROVIDERS:
        raise ProviderUnavailable(f"unknown RDMA provider {name!r}: expected one of "
                                  f"auto, {', '.join(PROVIDERS)}")
    provider = _instances.get(name)
    if provider is None:
        with _instances_lock:       # one per process, also when paths connect in parallel
            provider = _instances.get(name)
            if provider is None:
                if name == "soft":
                    from blockfabric.rdma.soft import SoftProvider
                    provider = _instances[name] = SoftProvider()
                else:
                    from blockfabric.rdma.verbs import VerbsProvider
                    provider = _instances[name] = VerbsProvider()
    return provider
