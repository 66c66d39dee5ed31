"""``blockfabric-target``: the NVMe-oF target daemon and its tools."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from blockfabric import __version__
from blockfabric.cliutil import EXIT_USAGE, HelpFormatter
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

A listener with "transport: tcp" serves the same subsystems over NVMe/TCP instead, for any
host with the kernel's nvme-tcp (nvme connect -t tcp) and no RDMA at all (docs/tcp.md).
"""

EPILOG = """\
examples:
  blockfabric-target run --config configs/target.yaml
  blockfabric-target check --config /etc/blockfabric/target.yaml
  blockfabric-target check --explain nqn.2014-08.org.nvmexpress:uuid:... --nqn NQN
  blockfabric-target status
  systemctl reload blockfabric-target   (SIGHUP: apply the edited configuration)

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
                    "was expected, and exit 2. The effective configuration includes the "
                    "hosts' DH-HMAC-CHAP secrets, as the file does; an error never repeats "
                    "a secret.")
    check.add_argument("-C", "--config", metavar="PATH",
                       help=f"YAML configuration file (default: {DEFAULT_CONFIG}, or the "
                            "embedded default configuration where that file does not exist)")
    check.add_argument("--explain", metavar="HOSTNQN",
                       help="instead of printing the configuration, say whether this host may "
                            "connect, to which subsystems, on which listeners and providers, "
                            "and why not (exit 0 if it can connect, 1 if not)")
    check.add_argument("-n", "--nqn", metavar="SUBNQN",
                       help="with --explain: only this subsystem")

    status = sub.add_parser(
        "status", help="show listeners, subsystems, controllers and counters of a running target",
        formatter_class=HelpFormatter)
    status.add_argument("--socket", metavar="PATH",
                        help="control socket of the running target (default: control_socket "
                             f"of --config, else {config_model.DEFAULT_CONTROL_SOCKET})")
    status.add_argument("-C", "--config", metavar="PATH",
                        help="read the control socket's path from this configuration")
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
        if args.explain:
            return check_explain(args.config, args.explain, args.nqn)
        if args.nqn:
            parser.error("--nqn goes with --explain")
        return check(args.config)
    if args.command == "run":
        return run(args.config, args.verbose)
    return status(args.socket, args.config, args.output_format)


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


def check_explain(path: str | None, hostnqn: str, subnqn: str | None) -> int:
    """Say why ``hostnqn`` can or cannot connect; exit 0 if it can, 1 if not."""
    from blockfabric.target.explain import explain
    try:
        config, _shown = load_config(path)
    except ConfigError as exc:
        print(f"blockfabric-target: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    text, ok = explain(config, hostnqn, subnqn)
    sys.stdout.write(text)
    return 0 if ok else 1


def status(socket_path: str | None, config_path: str | None, output_format: str) -> int:
    """Ask the running target over its control socket; print for a person or as JSON."""
    import json

    from blockfabric.target.control import ControlError, format_status, request
    if socket_path is None:
        socket_path = config_model.DEFAULT_CONTROL_SOCKET
        if config_path is not None:
            try:
                socket_path = config_model.load(config_path).control_socket
            except ConfigError as exc:
                print(f"blockfabric-target: error: {exc}", file=sys.stderr)
                return EXIT_USAGE
    try:
        answer = request(socket_path, "status")
    except ControlError as exc:
        print(f"blockfabric-target: error: {exc}", file=sys.stderr)
        return 1
    if output_format == "json":
        json.dump(answer, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(format_status(answer))
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
        # Handlers only wake the reactor; the drain, the reload and their log lines run
        # there (a handler that logs can lose its signal: see Target.request_stop).
        def stop(signum: int, _frame: object) -> None:
            name = signal.Signals(signum).name
            target.request_stop(lambda: log.info("%s: draining and stopping", name))

        def reload(_signum: int, _frame: object) -> None:
            target.request_reload(lambda: load_config(path)[0],
                                  lambda: log.info("SIGHUP: reloading %s", shown))

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        signal.signal(signal.SIGHUP, reload)
        try:
            target.start()
        except (OSError, BlockfabricError) as exc:
            print(f"blockfabric-target: error: cannot listen: {exc}", file=sys.stderr)
            return 1
        log.info("ready: %d listener(s), %d subsystem(s) from %s", len(target.listeners),
                 len(target.subsystems), shown)
        sd_notify(f"READY=1\nSTATUS=serving {len(target.listeners)} listener(s)\n"
                  f"MAINPID={os.getpid()}")
        target.serve_forever()
        if not target.draining:         # stopped some other way: still say so
            sd_notify("STOPPING=1")
    log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
