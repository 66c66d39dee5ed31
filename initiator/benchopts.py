"""``blockfabric bench``'s options: one run's workload with fio's names, and their checks.

fio, not the configuration files, sets the syntax here (sizes such as ``4k``), because these
flags are meant to be pasted from fio command lines.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from blockfabric.errors import BlockfabricError

if TYPE_CHECKING:
    from blockfabric.initiator.host import HostNamespace

PATTERNS = ("read", "write", "randread", "randwrite", "randrw")

_FIO_SIZE = re.compile(r"(?P<n>[0-9]+)\s*(?P<unit>[kmgtp]?)(?:i?b)?", re.IGNORECASE)
_UNIT_SHIFT = {"": 0, "k": 10, "m": 20, "g": 30, "t": 40, "p": 50}


class BenchError(BlockfabricError):
    """The benchmark cannot run as asked (bad size, alignment, capacity)."""


def parse_fio_size(text: str | int) -> int:
    """A size as fio reads it with its default kb_base=1024: ``4k``, ``128K``, ``1m``,
    ``1MiB``, ``2g`` or a plain byte count.  fio, not the config files, sets the syntax here,
    because these flags are meant to be pasted from fio command lines."""
    if isinstance(text, int):
        return text
    match = _FIO_SIZE.fullmatch(text.strip())
    if match is None:
        raise BenchError(f"size {text!r}: expected a number with an optional k/m/g/t suffix "
                         "(4k, 128k, 1m)")
    return int(match["n"]) << _UNIT_SHIFT[match["unit"].lower()]


@dataclass
class BenchOptions:
    """One run's workload, with fio's option names."""

    rw: str = "randread"
    bs: int = 4096
    iodepth: int = 16
    numjobs: int = 1
    size: int | None = None          # None: from offset to the end of the namespace
    offset: int = 0
    runtime: float = 10.0            # seconds; 0 with time_based off: no time limit
    time_based: bool = True
    ramp_time: float = 0.0
    rwmixread: int = 50
    verify: str | None = None
    nsid: int | None = None          # None: the first active namespace
    seed: int = 1
    name: str | None = None
    eta: str = "auto"                # auto (when stderr is a TTY), always, never
    controllers: str = "shared"      # shared: one controller for all jobs; per-job
    group_reporting: bool = False
    #: fio's --thread: the jobs are threads of one process; else (numjobs > 1) one process
    #: per job, each with its own controller (benchjobs.py)
    thread: bool = False
    cpus: frozenset[int] | None = None   # --cpus: pin the process(es) there

    @property
    def random(self) -> bool:
        return self.rw.startswith("rand")

    @property
    def writes(self) -> bool:
        return self.rw in ("write", "randwrite", "randrw")

    @property
    def jobname(self) -> str:
        return self.name or f"{self.rw}-{short_size(self.bs)}-qd{self.iodepth}"

    def layout(self, ns: HostNamespace, max_transfer: int) -> tuple[int, int]:
        """Where the jobs go in ``ns``: (first byte, bytes per job), once every option is
        checked against the namespace and the controller's ``max_transfer`` (MDTS)."""
        if self.rw not in PATTERNS:
            raise BenchError(f"--rw {self.rw}: expected one of {', '.join(PATTERNS)}")
        if self.iodepth < 1 or self.numjobs < 1:
            raise BenchError("--iodepth and --numjobs must be at least 1")
        if not 0 <= self.rwmixread <= 100:
            raise BenchError("--rwmixread must be 0..100")
        if self.bs <= 0 or self.bs % ns.block_size:
            raise BenchError(f"--bs {self.bs} must be a multiple of the namespace's "
                             f"{ns.block_size}-byte block size")
        if self.bs > max_transfer:
            raise BenchError(f"--bs {self.bs} exceeds the controller's maximum transfer "
                             f"size of {max_transfer} bytes (MDTS)")
        if self.offset % ns.block_size or self.offset >= ns.size:
            raise BenchError(f"--offset {self.offset} must be block-aligned and inside the "
                             f"{ns.size}-byte namespace")
        size = ns.size - self.offset if self.size is None else self.size
        if self.offset + size > ns.size:
            raise BenchError(f"--offset {self.offset} + --size {size} exceed the "
                             f"{ns.size}-byte namespace {ns.nsid}")
        if self.verify and self.writes and self.numjobs > 1:
            size //= self.numjobs   # each job verifies its own slice, as offset_increment
        size -= size % self.bs
        if size < self.bs:
            raise BenchError(f"--size leaves each job less than one {self.bs}-byte block")
        if self.verify and self.writes and self.time_based and size // self.bs <= self.iodepth:
            raise BenchError("--verify with writes needs more blocks per job than --iodepth")
        return self.offset, size


def options_from_args(args: argparse.Namespace) -> BenchOptions:
    return BenchOptions(
        rw=args.rw, bs=parse_fio_size(args.bs), iodepth=args.iodepth, numjobs=args.numjobs,
        size=None if args.size is None else parse_fio_size(args.size),
        offset=parse_fio_size(args.offset), runtime=args.runtime, time_based=args.time_based,
        ramp_time=args.ramp_time, rwmixread=args.rwmixread, verify=args.verify,
        nsid=args.nsid, seed=args.seed, name=args.name, eta=args.eta,
        controllers=args.controllers, group_reporting=args.group_reporting,
        thread=args.thread, cpus=args.cpus)


def short_size(n: int) -> str:
    """4096 -> "4k", as in a fio job name."""
    for shift, suffix in ((30, "g"), (20, "m"), (10, "k")):
        if n and n % (1 << shift) == 0:
            return f"{n >> shift}{suffix}"
    return str(n)
