"""How the target serves, in its configuration: its listeners, limits, keep-alive and
metrics endpoint, and the kinds of the keys that place its processes (reactors, NUMA).

The section models of :mod:`blockfabric.target.config` (which re-exports them all) for the
``listeners``, ``limits``, ``keep_alive`` and ``metrics`` keys; each checks itself
(``_finish``), and what needs the whole configuration (two listeners on one port, a
listener's queue size above ``limits``) is checked by
:class:`~blockfabric.target.config.TargetConfig`.
"""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass
from typing import Any, ClassVar

from blockfabric import numa
from blockfabric.schema import Address, Choice, Int, Kind, Model, Size, Where, Text, setting
from blockfabric.sizes import KiB, MiB, format_size

NVME_RDMA_PORT = 4420
PROVIDERS = ("auto", "soft", "verbs")
#: The most poll groups (``reactors``) a target runs.
REACTORS_MAX = 256

_NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")


class Reactors(Kind):
    """``reactors``: a number of poll groups, or ``auto`` (one per CPU this process may
    run on)."""

    expected = f"an integer from 1 to {REACTORS_MAX} or \"auto\" (one per usable CPU)"

    def load(self, value: Any, where: Where) -> Any:
        if value == "auto":
            return value
        if isinstance(value, bool) or not isinstance(value, int) \
                or not 1 <= value <= REACTORS_MAX:
            where.fail(self.expected, value)
        return value


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, e.g. a systemd CPUAffinity=)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


class NumaNode(Kind):
    expected = "auto, none or a NUMA node number"

    def load(self, value: Any, where: Where) -> str | int:
        if value in ("auto", "none") or (isinstance(value, int) and not isinstance(value, bool)
                                         and 0 <= value < 1024):
            return value
        where.fail(self.expected, value)


class CpuList(Kind):
    expected = 'a CPU list in the kernel\'s syntax ("0-3,8", as taskset -c)'

    def load(self, value: Any, where: Where) -> frozenset[int]:
        try:
            cpus = numa.parse_cpulist(value) if isinstance(value, (str, int)) else None
        except ValueError as exc:
            where.fail(f"{self.expected}; {exc}", value)
        if not cpus:
            where.fail(self.expected, value)
        return cpus

    def dump(self, value: frozenset[int]) -> str:
        return numa.format_cpulist(value)


NAME = Text("a name of 1 to 64 letters, digits, '_', '.' or '-'", _NAME_RE)


@dataclass(frozen=True, kw_only=True)
class Listener(Model):
    """An address the target accepts connections on: NVMe-oF over RDMA (``provider``: the
    soft provider or verbs) or NVMe/TCP (``transport: tcp``; ``provider`` does not apply).
    Both transports serve the same subsystems, controllers, ACLs and authentication."""

    WHAT: ClassVar[str] = "a listener"

    transport: str = setting(Choice("rdma", "tcp"), "rdma")
    provider: str = setting(Choice(*PROVIDERS), "auto")
    address: str = setting(Address())
    port: int = setting(Int(1, 65535), NVME_RDMA_PORT)
    name: str | None = setting(NAME, None)
    #: NVMe/TCP only: CPDA in ICResp, the alignment ((cpda + 1) x 4 bytes) the host must
    #: pad the data of its capsules and H2CData PDUs to; 0: none (as every target does).
    cpda: int = setting(Int(0, 31), 0)
    #: Queues (admin and I/O, every host) connected through this listener at once; a
    #: Connect past it is refused with Controller Busy (0x181).  Unset: only
    #: limits.max_connections_per_host and limits.max_unconnected_queues apply.
    max_connections: int | None = setting(Int(1, 65535), None)
    #: I/O queues per controller created through this listener (at most
    #: limits.max_io_queues): Set Features Number of Queues grants no more, a Connect for a
    #: higher qid gets Connect Invalid Parameters (0x182, IPO 42).
    max_io_queues: int | None = setting(Int(1, 128), None)
    #: Queue depth of controllers created through this listener (at most limits.queue_size):
    #: advertised in CAP.MQES, a Connect asking more gets Connect Invalid Parameters (0x182,
    #: IPO 44).
    queue_size: int | None = setting(Int(16, 1024), None)

    @property
    def endpoint(self) -> str:
        """``address:port``, with an IPv6 address in brackets."""
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"{host}:{self.port}"

    @property
    def is_wildcard(self) -> bool:
        return ipaddress.ip_address(self.address).is_unspecified

    def _finish(self, where: Where) -> Listener:
        if self.cpda and self.transport != "tcp":
            where.at("cpda").fail("0 (cpda applies to NVMe/TCP listeners)", self.cpda)
        return self


#: What one command may have queued besides its data: frame headers, the response capsule,
#: an acknowledgement, and the provider's cost of each queued buffer.
UNSENT_SLACK = 4 * KiB


@dataclass(frozen=True, kw_only=True)
class Limits(Model):
    """Queue and transfer limits the controller advertises (defaults as the Linux target)."""

    WHAT: ClassVar[str] = "the limits"

    queue_size: int = setting(Int(16, 1024), 128)
    max_io_queues: int = setting(Int(1, 128), 8)
    inline_data_size: int = setting(Size(0, 16 * KiB, multiple_of=16), 4 * KiB)
    # One keyed SGL descriptor moves at most 16 MiB - 1, so 8 MiB is the largest power of two.
    mdts: int = setting(Size(4 * KiB, 8 * MiB, multiple_of=4 * KiB, power_of_two=True), MiB)
    max_connections_per_host: int = setting(Int(1, 65535), 64)
    #: Seconds a queue may stay connected (rdma_cm) without completing a Fabrics Connect
    #: before it is disconnected, so that silent peers cannot keep connection slots.
    connect_timeout: int = setting(Int(1, 3600, unit="seconds"), 10)
    #: Queues accepted (rdma_cm) whose Fabrics Connect has not completed, across all peer
    #: addresses; past it a new connection gets CM reject NO_RESOURCES.
    max_unconnected_queues: int = setting(Int(1, 65535), 128)
    #: Connection requests each listener holds before they are whole (the soft provider
    #: reads them itself): past it the oldest is dropped for the newest.
    max_pending_requests: int = setting(Int(1, 65535), 128)
    #: Seconds a connection request may take to arrive whole before it is dropped.
    request_timeout: int = setting(Int(1, 60, unit="seconds"), 5)
    #: Bytes of frames a queue may hold unsent because its peer does not read them (soft
    #: provider; queued buffers count 128 B more each), past which the queue is cut.  0: the
    #: queue's depth x (mdts + inline_data_size + 4 KiB), what a well-behaved host can
    #: legitimately have in flight.
    max_unsent_bytes: int = setting(Size(0, 64 * 1024 * MiB), 0)
    #: Seconds a command may keep a shared bounce buffer waiting on its host (an RDMA READ
    #: of the host's data not answered, an answer not acknowledged) before the target
    #: disconnects that queue and tears its controller down, so that no host can hoard the
    #: buffers the other hosts' file-backed I/O needs.  On NVMe/TCP also how long a host
    #: may owe the data of an R2T without sending any before that queue is cut (the
    #: command holds the volume's memory and its in-flight count).  Far above any real
    #: transfer.
    buffer_hold_timeout: int = setting(Int(1, 3600, unit="seconds"), 30)
    #: Seconds a queue that must authenticate (DH-HMAC-CHAP) may take from its Connect to a
    #: finished exchange, and a failed exchange to be answered, before its controller ends.
    auth_timeout: int = setting(Int(1, 600, unit="seconds"), 10)
    #: Seconds a poll-group worker (``reactors`` > 1) has to start (Python's imports, its
    #: volumes opened) before the target gives up on starting: a slow machine (an emulated
    #: CPU, a loaded host, RBD images far away) may need more.  Below the unit's
    #: TimeoutStartSec (90).
    worker_start_timeout: int = setting(Int(1, 3600, unit="seconds"), 60)
    #: Failed authentications from one peer address within auth_failure_window seconds
    #: that make the target refuse that address's authenticating Connects (Controller
    #: Busy) for auth_backoff seconds.
    auth_max_failures: int = setting(Int(1, 1000), 5)
    auth_failure_window: int = setting(Int(1, 86400, unit="seconds"), 60)
    auth_backoff: int = setting(Int(1, 86400, unit="seconds"), 60)

    def _finish(self, where: Where) -> Limits:
        if 0 < self.max_unsent_bytes < MiB:
            where.at("max_unsent_bytes").fail("0 (derived from the queue) or at least 1MiB",
                                              format_size(self.max_unsent_bytes))
        return self

    def unsent_limit(self, depth: int, inline: int) -> int:
        """``max_unsent_bytes`` for a queue of ``depth`` commands with ``inline`` bytes of
        in-capsule data."""
        return self.max_unsent_bytes or depth * (self.mdts + inline + UNSENT_SLACK)


@dataclass(frozen=True, kw_only=True)
class KeepAlive(Model):
    """Keep-alive granularity (Identify KAS) and the longest timeout a host may ask for."""

    WHAT: ClassVar[str] = "the keep-alive settings"

    kas_ms: int = setting(Int(100, 6_553_500, multiple_of=100), 1000)
    max_timeout_ms: int = setting(Int(100, 3_600_000), 300_000)

    def _finish(self, where: Where) -> KeepAlive:
        if self.max_timeout_ms < self.kas_ms:
            where.at("max_timeout_ms").fail(f"at least kas_ms ({self.kas_ms})",
                                            self.max_timeout_ms)
        return self


@dataclass(frozen=True, kw_only=True)
class Metrics(Model):
    """Where counters are served for scraping; off unless configured."""

    WHAT: ClassVar[str] = "the metrics endpoint"

    address: str = setting(Address(), "127.0.0.1")
    port: int = setting(Int(1, 65535))
