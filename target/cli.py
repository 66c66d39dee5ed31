"""``blockfabric-target``: the NVMe-oF target daemon and its tools."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from blockfabric import __version__
from blockfabric.cliutil import EXIT_USAGE, HelpFormatter, not_implemented
from blockfabric.errors import BlockfabricError, ConfigError
from blockfabric.sdnotify import sd_notify
from blockfabric.target import config as config_model

DEFAULT_CONFIG = "/etc/blockfabric/target.yaml"

DESCRIPTION = """\
Export file-, ramdisk- or null-backed volumes as NVMe namespaces over the NVMe-oF RDMA
transport binding. Commands arrive as NVMe command capsules in RDMA SEND; data moves one-sided,
with RDMA READ (host to target) and RDMA WRITE (target to host).

Two RDMA providers serve the same code: "verbs" (pyverbs and rdma_cm on a real RDMA device:
RoCE, InfiniBand, iWARP, rxe, siw) and "soft" (a software RDMA NIC over TCP, the default where
no RDMA device owns the listener address).
"""

EPILOG = """\
examples:
  blockfabric-target run --config configs/target.yaml
  blockfabric-target check --config /etc/blockfabric/target.yaml
  blockfabric-target status

files:
  /etc/blockfabric/target.yaml   default configuration
  /run/blockfabric/target.sock   control socket used by "status"

exit status:
  0 success, 1 runtime failure, 2 usage or configuration error
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="blockfabric-target", description=DESCRIPTION, epilog=EPILOG,
        formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    run = sub.add_parser(
        "run", help="run the target in the foreground, logging to stderr",
        formatter_class=HelpFormatter,
        description="Load the configuration, register every volume, open every listener and "
                    "serve until SIGTERM or SIGINT (drain, flush, exit 0). SIGHUP reloads the "
                    "configuration without dropping healthy connections.")
    run.add_argument("-C", "--config", metavar="PATH",
                     help=f"YAML configuration file (default: {DEFAULT_CONFIG}, or the "
                          "embedded default configuration where that file does not exist)")
    run.add_argument("-v", "--verbose", action="count", default=0,
                     help="more log detail (repeat for debug)")

    check = sub.add_parser(
        "check", help="validate a configuration and print the effective one",
        formatter_class=HelpFormatter,
        description="Load and validate the configuration without starting anything. On "
                    "success print the effective configuration (defaults filled in) as YAML "
                    "and exit 0; on error print one line naming the file, the key and what "
                    "was expected, and exit 2.")
    check.add_argument("-C", "--config", metavar="PATH",
                       help=f"YAML configuration file (default: {DEFAULT_CONFIG}, or the "
                            "embedded default configuration where that file does not exist)")

    status = sub.add_parser(
        "status", help="show listeners, subsystems, controllers and counters of a running target",
        formatter_class=HelpFormatter)
    status.add_argument("--socket", default="/run/blockfabric/target.sock", metavar="PATH",
                        help="control socket of the running target")
    status.add_argument("--output-format", choices=("normal", "json"), default="normal",
                        help="output format")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    if args.command == "check":
        return check(args.config)
    if args.command == "run":
        return run(args.config, args.verbose)
    return not_implemented(f"blockfabric-target {args.command}")


def load_config(path: str | None) -> tuple[config_model.TargetConfig, str]:
    """The configuration at ``path``; without one, /etc/blockfabric/target.yaml where it
    exists, else the embedded default.  Raises ConfigError."""
    if path is None and not os.path.exists(DEFAULT_CONFIG):
        return config_model.default_config(), "the embedded default"
    path = path or DEFAULT_CONFIG
    return config_model.load(path), path


def check(path: str | None) -> int:
    """Validate a configuration; print the effective one (exit 0) or one error line (exit 2)."""
    try:
        config, shown = load_config(path)
    except ConfigError as exc:
        print(f"blockfabric-target: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    sys.stdout.write(f"# effective configuration of {shown} (defaults filled in)\n")
    sys.stdout.write(config.to_yaml())
    return 0


def run(path: str | None, verbose: int) -> int:
    """Serve in the foreground until SIGTERM/SIGINT; exit 0 after an orderly stop."""
    from blockfabric.logutil import setup_logging
    from blockfabric.target.server import Target

    setup_logging(verbose)
    log = logging.getLogger("blockfabric.target")
    try:
        config, shown = load_config(path)
    except ConfigError as exc:
        print(f"blockfabric-target: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        target = Target(config)
    except (OSError, BlockfabricError) as exc:
        print(f"blockfabric-target: error: {shown}: {exc}", file=sys.stderr)
        return 1
    with target:
        def stop(signum: int, _frame: object) -> None:
            log.info("%s: stopping", signal.Signals(signum).name)
            target.stop()

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        try:
            target.start()
        except (OSError, BlockfabricError) as exc:
            print(f"blockfabric-target: error: cannot listen: {exc}", file=sys.stderr)
            return 1
        log.info("ready: %d listener(s), %d subsystem(s) from %s", len(target.listeners),
                 len(target.subsystems), shown)
        sd_notify("READY=1\nSTATUS=serving")
        target.serve_forever()
        sd_notify("STOPPING=1")
    log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
