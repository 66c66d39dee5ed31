"""``blockfabric``: the host-side command line, in the spirit of nvme-cli."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Mapping

from blockfabric import __version__
from blockfabric.cliutil import HelpFormatter, not_implemented
from blockfabric.errors import BlockfabricError
from blockfabric.fabric.reactor import (DEFAULT_SPIN_US, SPIN_ENV, parse_spin_us,
                                         set_default_spin)
from blockfabric.initiator.multipath import parse_path_spec, parse_port, resolve_paths
from blockfabric.logutil import setup_logging

DESCRIPTION = """\
Use NVMe-oF RDMA subsystems exported by a blockfabric target (or by any NVMe-oF RDMA target,
such as the Linux kernel's nvmet-rdma). Remote namespaces are mounted through FUSE as regular
files (n1, n2, ...) that fio, dd, losetup and mkfs can use like local disk images.
"""

EPILOG = """\
examples:
  blockfabric discover -a 127.0.0.1
  blockfabric connect -a 127.0.0.1 -n nqn.2026-12.io.blockfabric:ram0
  blockfabric mount -a 127.0.0.1 -n nqn.2026-12.io.blockfabric:ram0 /mnt/ram0
  blockfabric list
  blockfabric umount /mnt/ram0
  blockfabric bench -a 127.0.0.1 -n nqn.2026-12.io.blockfabric:ram0 --rw randread --bs 4k
  blockfabric resv register --traddr 127.0.0.1 --nqn nqn.2026-12.io.blockfabric:ram0 -k 0xa1

host identity:
  --hostnqn, else /etc/nvme/hostnqn (as nvme-cli), else an NQN generated once and kept in
  /etc/blockfabric/hostnqn.

authentication:
  A subsystem that lists this host with a DH-HMAC-CHAP secret asks every queue to
  authenticate (NVMe in-band authentication, as `nvme connect --dhchap-secret`): give the
  same secret with --dhchap-secret, or dhchap_secret in the initiator YAML. Make secrets
  with `blockfabric gen-dhchap-key`. Authentication proves who the host is; the data itself
  is not encrypted.

exit status:
  0 success, 1 runtime failure, 2 usage error
"""


def _port(text: str) -> str:
    try:
        return str(parse_port(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: expected {exc}") from None


def _path(text: str) -> tuple:
    try:
        return parse_path_spec(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: expected {exc}") from None


def add_connection_flags(p: argparse.ArgumentParser, *, needs_nqn: bool = True,
                         multipath: bool = False, short: bool = True) -> None:
    """The flags nvme-cli uses for a fabrics connection, with the same names and units;
    ``multipath`` adds ``--path`` (for commands that hold a controller through failures);
    ``short`` False leaves -a -n -t -k -c -i to the command (nvme resv-* use them)."""
    def s(flag: str) -> tuple[str, ...]:
        return (flag,) if short else ()
    from blockfabric.initiator.initiator_config import CONNECT_DEFAULTS as default

    p.add_argument(*s("-a"), "--traddr", required=True, metavar="ADDR",
                   help="target transport address (IPv4 or IPv6)")
    p.add_argument("-s", "--trsvcid", default=default["trsvcid"], type=_port, metavar="PORT",
                   help="target transport service id (port)")
    if multipath:
        p.add_argument("--path", dest="paths", action="append", type=_path,
                       metavar="ADDR[:PORT]",
                       help="another listener (gateway) of the same subsystem: the host "
                            "connects to every path at once and sends I/O to the ANA-"
                            "optimized ones, moving it when a path is lost (multipath "
                            "failover); repeatable; PORT "
                            "defaults to -s; write an IPv6 address as [ADDR] or [ADDR]:PORT; "
                            "tcp:// or rdma:// first: that path goes over that transport "
                            "(else over -t's), so one host can mix NVMe/TCP and RDMA paths")
    if needs_nqn:
        p.add_argument(*s("-n"), "--nqn", required=True, metavar="SUBNQN",
                       help="NVMe qualified name of the subsystem")
    p.add_argument("-q", "--hostnqn", metavar="HOSTNQN", help="this host's NQN")
    p.add_argument("-I", "--hostid", metavar="UUID", help="this host's identifier")
    p.add_argument(*s("-t"), "--transport", choices=("rdma", "tcp"),
                   default=default["transport"],
                   help="rdma (NVMe-oF over RDMA: --provider) or tcp (NVMe/TCP: any NVMe/TCP "
                        "target, no RDMA device needed)")
    p.add_argument("-g", "--hdr-digest", action="store_true",
                   help="NVMe/TCP: CRC32C header digest on every PDU")
    p.add_argument("-G", "--data-digest", action="store_true",
                   help="NVMe/TCP: CRC32C data digest on every PDU with data")
    p.add_argument("--provider", choices=("auto", "soft", "verbs"),
                   default=default["provider"],
                   help="RDMA provider: verbs needs an RDMA device owning a local address on "
                        "the route to the target; soft is software RDMA over TCP")
    p.add_argument(*s("-i"), "--nr-io-queues", type=int, default=default["nr_io_queues"],
                   metavar="N",
                   help="number of I/O queues")
    p.add_argument("-Q", "--queue-size", type=int, default=default["queue_size"], metavar="N",
                   help="I/O queue depth (16..1024)")
    p.add_argument(*s("-k"), "--keep-alive-tmo", type=int, default=default["keep_alive_tmo"],
                   metavar="SEC",
                   help="keep-alive timeout in seconds")
    p.add_argument(*s("-c"), "--reconnect-delay", type=int, default=default["reconnect_delay"],
                   metavar="SEC",
                   help="seconds between reconnect attempts")
    p.add_argument("-l", "--ctrl-loss-tmo", type=int, default=default["ctrl_loss_tmo"],
                   metavar="SEC",
                   help="seconds to keep reconnecting before failing I/O (-1: forever)")
    p.add_argument("-S", "--dhchap-secret", metavar="DHHC-1:XX:KEY:",
                   help="this host's DH-HMAC-CHAP secret, used when the subsystem asks the "
                        "host to authenticate; a command line is visible to other users "
                        "(ps), so prefer dhchap_secret in a root-only initiator YAML")
    p.add_argument("-C", "--dhchap-ctrl-secret", metavar="DHHC-1:XX:KEY:",
                   help="the controller's DH-HMAC-CHAP secret: authenticate the controller "
                        "too and refuse one that cannot prove it holds this secret (needs "
                        "--dhchap-secret)")
    p.add_argument("--spin-us", type=_spin_us, default=None, metavar="US",
                   help="microseconds the host's reactor busy-polls for what it expects "
                        "next (an answer, a mount's next request) before it sleeps, yielding "
                        "the CPU at each turn (adaptive: none while answers come later, at "
                        "depth or under CPU pressure; 0: never, for a machine whose cores "
                        "other work keeps busy; default $BLOCKFABRIC_REACTOR_SPIN_US, else "
                        f"{DEFAULT_SPIN_US:g})")
    p.add_argument("-v", "--verbose", action="store_true", help="log what happens")


def _cpus(text: str) -> frozenset[int]:
    from blockfabric.numa import parse_cpulist
    try:
        cpus = parse_cpulist(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None
    if not cpus:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a CPU list such as 0-3,8")
    return cpus


def add_cpus_flag(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--cpus", type=_cpus, metavar="LIST",
                   help=f"pin {what} to these CPUs (taskset -c syntax: 0-3,8) and place its "
                        "memory on their NUMA node; default: the CPUs of the NUMA node of the "
                        "NIC the route to the target leaves by, on a machine with more than "
                        "one node (docs/numa.md)")


def _spin_us(text: str) -> float:
    try:
        return parse_spin_us(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _fuse_workers(text: str) -> int:
    from blockfabric.initiator.fuse_workers import MAX_WORKERS
    if not text.isdigit() or not 1 <= int(text) <= MAX_WORKERS:
        raise argparse.ArgumentTypeError(f"expected 1 to {MAX_WORKERS}, got {text!r}")
    return int(text)


def add_output_format(p: argparse.ArgumentParser) -> None:
    p.add_argument("-o", "--output-format", choices=("normal", "json"), default="normal",
                   help="output format")


class CommandParser(argparse.ArgumentParser):
    """The top-level parser, which also keeps each command's parser (for its usage
    errors)."""

    commands: Mapping[str, argparse.ArgumentParser]


def build_parser() -> CommandParser:
    parser = CommandParser(prog="blockfabric", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("discover",
                       help="list the subsystems a discovery controller offers this host",
                       formatter_class=HelpFormatter,
                       description="Connect to the discovery controller "
                                   "(nqn.2014-08.org.nvmexpress.discovery), read the discovery "
                                   "log page and print its entries. Only subsystems this host "
                                   "may use are listed.")
    add_connection_flags(p, needs_nqn=False)
    add_output_format(p)

    p = sub.add_parser("connect", help="connect to a subsystem, print what was found, disconnect",
                       formatter_class=HelpFormatter,
                       description="A connectivity check: set up the admin queue and the I/O "
                                   "queues exactly as a mount would, print the controller and "
                                   "its namespaces, then disconnect. A controller lives as long "
                                   "as the process holding it (a mount, a bench run).")
    add_connection_flags(p, multipath=True)
    add_output_format(p)

    p = sub.add_parser("identify", help="print Identify Controller and Identify Namespace data",
                       formatter_class=HelpFormatter)
    add_connection_flags(p)
    p.add_argument("--namespace-id", type=int, metavar="NSID",
                   help="only this namespace (default: the controller and every active namespace)")
    add_output_format(p)

    p = sub.add_parser("mount", help="mount a subsystem's namespaces as files through FUSE",
                       formatter_class=HelpFormatter,
                       description="Connect, then mount a FUSE filesystem at MOUNTPOINT in "
                                   "which namespace NSID is the file n<NSID> and .status "
                                   "describes the controller. Runs in the background unless -f.")
    add_connection_flags(p, multipath=True)
    for action in p._actions:   # not required with --config: checked by the command
        if action.dest in ("traddr", "nqn"):
            action.required = False
    p.add_argument("mountpoint", metavar="MOUNTPOINT", nargs="?")
    p.add_argument("-f", "--foreground", action="store_true", help="stay in the foreground")
    p.add_argument("-o", dest="options", default="", metavar="OPT[,OPT...]",
                   help="mount options: ro, allow_other, direct_io (default) or cache (the "
                        "page cache); binding=kernel (default: blockfabric's own /dev/fuse "
                        "server on the controller's event loop) or binding=libfuse (mfusepy "
                        "on libfuse 3, a pool of worker threads); threads=N (kernel: threads "
                        "for requests that must wait, default 4; libfuse: worker pool, "
                        "default 16; 1 = single-threaded); anything else is passed on as a "
                        "FUSE mount option")
    p.add_argument("--config", metavar="FILE",
                   help="mount what an initiator YAML lists (configs/initiator.yaml): the "
                        "entry for MOUNTPOINT, or every entry with --all")
    p.add_argument("--all", action="store_true", help="with --config: every listed mount")
    p.add_argument("--fuse-workers", type=_fuse_workers, default=None, metavar="N",
                   help="processes serving the FUSE requests (default 1): the mount process "
                        "and N-1 worker processes, each on a clone of the FUSE session "
                        "(FUSE_DEV_IOC_CLONE) with its own share of the controller's I/O "
                        "queues (-i is the total, raised to N), so that the host side can use "
                        "N cores; more than 1 only where the mount process's core is the "
                        "limit and the machine has cores to spare (measured: "
                        "docs/scaling.md); kernel binding only (docs/fuse.md)")
    add_cpus_flag(p, "the mount process")
    p.add_argument("--output-format", choices=("normal", "json"), default="normal",
                   help="output format")

    p = sub.add_parser("umount", help="unmount a blockfabric mount and disconnect its controller",
                       formatter_class=HelpFormatter,
                       description="Unmount (fusermount3 -u) and wait until the mount's "
                                   "process has disconnected its controller and exited.")
    p.add_argument("mountpoint", metavar="MOUNTPOINT")
    p.add_argument("-v", "--verbose", action="store_true", help="log what happens")

    p = sub.add_parser("list", help="list active mounts and their controllers",
                       formatter_class=HelpFormatter,
                       description="List the mounts recorded under /run/blockfabric whose "
                                   "process is alive and still mounted; stale records are "
                                   "removed.")
    add_output_format(p)
    p.add_argument("-v", "--verbose", action="store_true", help="log what happens")

    p = sub.add_parser("disconnect", help="disconnect the controller of a mount (by subsystem NQN)",
                       formatter_class=HelpFormatter)
    p.add_argument("-n", "--nqn", required=True, metavar="SUBNQN", help="subsystem NQN")
    p.add_argument("-v", "--verbose", action="store_true", help="log what happens")

    p = sub.add_parser("bench", help="fio-style benchmark through the host library (no FUSE)",
                       formatter_class=HelpFormatter,
                       description="Drive one namespace through the host library, with fio's "
                                   "option names, and report IOPS, bandwidth and completion "
                                   "latency percentiles like fio (or fio's JSON with -o json). "
                                   "Runs for --runtime seconds by default (fio's time_based); "
                                   "with --no-time_based each job makes one pass over its "
                                   "region. Commands lost with a connection are held "
                                   "while the host reconnects (on the --path listeners too) "
                                   "and re-issued, as through a mount; they fail after "
                                   "--ctrl-loss-tmo. Exits 1 on any I/O error or verify "
                                   "failure.")
    add_connection_flags(p, multipath=True)
    p.add_argument("--name", metavar="NAME", help="job name (default: RW-BS-qdN)")
    p.add_argument("--rw", "--readwrite", dest="rw", default="randread",
                   choices=("read", "write", "randread", "randwrite", "randrw"),
                   help="I/O pattern")
    p.add_argument("--bs", default="4k", metavar="SIZE",
                   help="block size, in fio's syntax (4k, 128k, 1m)")
    p.add_argument("--iodepth", type=int, default=16, metavar="N",
                   help="commands in flight per job")
    p.add_argument("--numjobs", type=int, default=1, metavar="N",
                   help="parallel jobs, each in its own process with its own controller "
                        "(as fio), so that N jobs can use N cores")
    p.add_argument("--thread", action="store_true",
                   help="run the jobs as threads of one process instead (fio's --thread), "
                        "sharing one controller unless --controllers per-job")
    p.add_argument("--controllers", choices=("shared", "per-job"), default="shared",
                   help="with --thread: jobs share one controller (one reactor thread), or "
                        "each job connects its own")
    add_cpus_flag(p, "the benchmark (each job process its own share of the list)")
    p.add_argument("--size", default=None, metavar="SIZE",
                   help="region of the namespace to use (default: from --offset to the end)")
    p.add_argument("--offset", default="0", metavar="SIZE", help="start of the region")
    p.add_argument("--runtime", type=float, default=10.0, metavar="SEC",
                   help="seconds to run, after --ramp_time")
    p.add_argument("--time_based", action=argparse.BooleanOptionalAction, default=True,
                   help="run for --runtime, wrapping around the region; --no-time_based: "
                        "one pass over the region (--runtime 0: no time limit)")
    p.add_argument("--ramp_time", type=float, default=0.0, metavar="SEC",
                   help="run this long before counting")
    p.add_argument("--rwmixread", type=int, default=50, metavar="PCT",
                   help="percentage of reads with randrw")
    p.add_argument("--verify", choices=("crc32c",),
                   help="write blocks with a header and CRC-32C, check every block read; "
                        "writing jobs read back what they wrote at the end")
    p.add_argument("--nsid", "--namespace-id", dest="nsid", type=int, metavar="NSID",
                   help="namespace (default: the first active one)")
    p.add_argument("--seed", "--randseed", dest="seed", type=int, default=1, metavar="N",
                   help="seed of the offsets, the read/write mix and the data")
    p.add_argument("--eta", choices=("auto", "always", "never"), default="auto",
                   help="progress once a second on stderr (auto: when it is a terminal)")
    p.add_argument("--group_reporting", action="store_true",
                   help="report all jobs together")
    add_output_format(p)

    p = sub.add_parser("gen-dhchap-key",
                       help="generate a DH-HMAC-CHAP secret (as nvme gen-dhchap-key)",
                       formatter_class=HelpFormatter,
                       description="Print a new random DH-HMAC-CHAP secret in the "
                                   "'DHHC-1:XX:<base64 of key and CRC-32>:' form that "
                                   "nvme-cli and the kernel read, for the host's "
                                   "--dhchap-secret and the target's hosts[].dhchap_secret "
                                   "(or, for a controller secret, --dhchap-ctrl-secret and "
                                   "hosts[].dhchap_ctrl_secret). XX is how the key is "
                                   "transformed before use: 00 not at all, 01/02/03 with "
                                   "HMAC-SHA-256/384/512 keyed by the secret over the NQN of "
                                   "whoever uses it, when it is used. The key printed is "
                                   "random; --nqn is accepted for nvme-cli's syntax and does "
                                   "not change it.",
                       epilog="examples:\n"
                              "  blockfabric gen-dhchap-key -m 1 -n $(cat /etc/nvme/hostnqn)\n"
                              "  blockfabric gen-dhchap-key --key-length 64 --hmac 3\n\n"
                              "exit status:\n  0 success, 2 usage error\n")
    p.add_argument("-m", "--hmac", type=int, choices=(0, 1, 2, 3), default=0,
                   help="key transformation: 0 none, 1 SHA-256, 2 SHA-384, 3 SHA-512")
    p.add_argument("-l", "--key-length", type=int, choices=(32, 48, 64), default=None,
                   help="key length in bytes (default: 32, or the hash's length with --hmac)")
    p.add_argument("-n", "--nqn", metavar="NQN",
                   help="the NQN the key is for (accepted as nvme-cli does; not used)")
    p.add_argument("-v", "--verbose", action="store_true", help="log what happens")
    from blockfabric.initiator.resv import add_parsers as add_resv_parsers
    add_resv_parsers(sub, HelpFormatter, add_connection_flags, add_output_format)
    parser.commands = sub.choices        # each command's parser, for its usage errors
    return parser


def cmd_gen_dhchap_key(args: argparse.Namespace) -> int:
    from blockfabric.protocol.auth import generate_secret
    length = args.key_length or {0: 32, 1: 32, 2: 48, 3: 64}[args.hmac]
    print(generate_secret(length, args.hmac))
    return 0


# command -> (module under blockfabric.initiator, function); imported only when used, so
# `blockfabric --help` stays fast and a missing optional dependency only affects its command.
HANDLERS = {
    "discover": ("commands", "cmd_discover"),
    "connect": ("commands", "cmd_connect"),
    "identify": ("commands", "cmd_identify"),
    "resv": ("resv", "cmd_resv"),
    "mount": ("mount", "cmd_mount"),
    "umount": ("mount", "cmd_umount"),
    "list": ("mount", "cmd_list"),
    "disconnect": ("mount", "cmd_disconnect"),
    "bench": ("bench", "cmd_bench"),
}


def _handler(command: str):
    import importlib
    module_name, func = HANDLERS[command]
    try:
        module = importlib.import_module(f"blockfabric.initiator.{module_name}")
    except ModuleNotFoundError as exc:
        if exc.name == f"blockfabric.initiator.{module_name}":
            return None
        raise
    return getattr(module, func, None)


def resolve_path_args(parser: CommandParser, args: argparse.Namespace) -> None:
    """Fill in --path's default ports now that -s is known; refuse repeats (usage errors)."""
    if not getattr(args, "paths", None):
        return
    command_parser = parser.commands[args.command]
    if not args.traddr:
        command_parser.error("--path goes with -a/-n (with --config, list further paths "
                             "under paths: in the initiator YAML)")
    try:
        args.paths = resolve_paths((args.traddr, int(args.trsvcid)), args.paths,
                                   getattr(args, "transport", None))
    except ValueError as exc:
        command_parser.error(f"--path: {exc}")


def _check_secrets(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A malformed --dhchap-secret is a usage error (exit 2), found before connecting."""
    given = {name: getattr(args, name, None) for name in ("dhchap_secret", "dhchap_ctrl_secret")}
    if not any(given.values()):
        return
    from blockfabric.protocol.auth import Secret
    for name, value in given.items():
        if value is not None:
            try:
                Secret.parse(value)
            except ValueError as exc:
                parser.error(f"--{name.replace('_', '-')}: {exc}")
    if given["dhchap_ctrl_secret"] and not given["dhchap_secret"]:
        parser.error("--dhchap-ctrl-secret needs --dhchap-secret too (the controller "
                     "authenticates only after the host has)")


def _check_cpus(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--cpus naming a CPU that is not online is a usage error."""
    cpus = getattr(args, "cpus", None)
    if cpus:
        from blockfabric.numa import Topology, format_cpulist
        online = Topology().online_cpus()
        if cpus - online:
            parser.error(f"--cpus {format_cpulist(cpus)}: CPU(s) {format_cpulist(cpus - online)}"
                         f" not online (online: {format_cpulist(online)})")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    resolve_path_args(parser, args)
    _check_secrets(parser, args)
    _check_cpus(parser, args)
    handler = cmd_gen_dhchap_key if args.command == "gen-dhchap-key" else _handler(args.command)
    if handler is None:
        return not_implemented(f"blockfabric {args.command}")
    setup_logging(1 if args.verbose else 0, level=logging.WARNING)
    if getattr(args, "spin_us", None) is not None:
        set_default_spin(args.spin_us)
        os.environ[SPIN_ENV] = f"{args.spin_us:g}"     # a re-executed mount daemon too
    try:
        return handler(args)
    except (BlockfabricError, OSError, TimeoutError) as exc:
        print(f"blockfabric {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
