"""The host CLI's connection commands: discover, connect, identify."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from blockfabric.initiator.host import (ConnectOptions, Controller, NvmeError, discover)
from blockfabric.initiator.multipath import format_path
from blockfabric.protocol import DiscoveryLogEntry
from blockfabric.sizes import human_size


def options(args: argparse.Namespace, subnqn: str) -> ConnectOptions:
    """ConnectOptions from the nvme-cli style flags."""
    return ConnectOptions(traddr=args.traddr, subnqn=subnqn, trsvcid=int(args.trsvcid),
                          hostnqn=args.hostnqn, hostid=_hostid(args.hostid),
                          provider=args.provider, transport=args.transport,
                          hdr_digest=args.hdr_digest, data_digest=args.data_digest,
                          nr_io_queues=args.nr_io_queues,
                          queue_size=args.queue_size, keep_alive_tmo=args.keep_alive_tmo,
                          reconnect_delay=args.reconnect_delay,
                          ctrl_loss_tmo=args.ctrl_loss_tmo,
                          paths=list(getattr(args, "paths", None) or []),
                          dhchap_secret=args.dhchap_secret,
                          dhchap_ctrl_secret=args.dhchap_ctrl_secret)


def _hostid(text: str | None) -> bytes | None:
    if text is None:
        return None
    import uuid
    return uuid.UUID(text).bytes


#: discovery log TRTYPE values as nvme-cli prints them
TRTYPES = {1: "rdma", 2: "fc", 3: "tcp", 254: "loop"}


def _entry_dict(i: int, e: DiscoveryLogEntry) -> dict[str, Any]:
    return {"entry": i, "trtype": TRTYPES.get(e.trtype, str(e.trtype)),
            "adrfam": {1: "ipv4", 2: "ipv6"}.get(e.adrfam, str(e.adrfam)),
            "subtype": {1: "referral", 2: "nvme subsystem", 3: "current discovery subsystem"
                        }.get(e.subtype, str(e.subtype)),
            "portid": e.portid, "trsvcid": e.trsvcid, "subnqn": e.subnqn, "traddr": e.traddr,
            "treq": e.treq, "cntlid": e.cntlid, "asqsz": e.asqsz}


def cmd_discover(args: argparse.Namespace) -> int:
    opts = options(args, "")
    entries = discover(opts.traddr, opts.trsvcid, hostnqn=opts.hostnqn, hostid=opts.hostid,
                       provider=opts.provider, transport=opts.transport,
                       hdr_digest=opts.hdr_digest, data_digest=opts.data_digest,
                       dhchap_secret=opts.dhchap_secret,
                       dhchap_ctrl_secret=opts.dhchap_ctrl_secret)
    records = [_entry_dict(i, e) for i, e in enumerate(entries)]
    if args.output_format == "json":
        json.dump({"genctr": None, "records": records}, sys.stdout, indent=2)
        print()
        return 0
    print(f"\nDiscovery Log Number of Records {len(records)}")
    print("=====Discovery Log Entry ...")
    for r in records:
        print(f"=====Discovery Log Entry {r['entry']}======")
        for key in ("trtype", "adrfam", "subtype", "portid", "trsvcid", "subnqn", "traddr"):
            print(f"{key + ':':9} {r[key]}")
    return 0


def controller_dict(ctrl: Controller) -> dict[str, Any]:
    ident = ctrl.identify
    assert ident is not None            # read when the controller connected
    return {
        "subnqn": ident.subnqn, "cntlid": ctrl.cntlid, "serial": ident.sn, "model": ident.mn,
        "firmware": ident.fr,
        "transport": "tcp" if ctrl.opts.transport == "tcp"
        else f"rdma ({ctrl.provider.name} provider)",
        "traddr": ctrl.opts.traddr, "trsvcid": ctrl.opts.trsvcid, "hostnqn": ctrl.hostnqn,
        "paths": [format_path(a, p) for a, p in ctrl.paths],
        # every path's controller and ANA states (a multipath controller), else None
        "ana_paths": ctrl.paths_view() if hasattr(ctrl, "paths_view") else None,
        "io_queues": len(ctrl.io_queues),
        "queue_size": ctrl.io_queues[0].depth if ctrl.io_queues else 0,
        "max_transfer": ctrl.max_transfer, "inline_data": ctrl.inline_size,
        "keep_alive_tmo": ctrl.opts.keep_alive_tmo,
        # how the admin queue authenticated (DH-HMAC-CHAP), or None: it was not asked to
        "authentication": ctrl.authenticated.get(0),
        "namespaces": [{"nsid": ns.nsid, "size": ns.size, "block_size": ns.block_size,
                        "blocks": ns.nblocks, "read_only": ns.read_only,
                        "nguid": ns.nguid.hex()} for ns in ctrl.namespaces.values()],
    }


def cmd_connect(args: argparse.Namespace) -> int:
    with Controller(options(args, args.nqn)).connect() as ctrl:
        info = controller_dict(ctrl)
        path_lines = ctrl.paths_lines() if hasattr(ctrl, "paths_lines") else []
    if args.output_format == "json":
        json.dump(info, sys.stdout, indent=2)
        print()
        return 0
    print(f"connected to {info['subnqn']} at {info['traddr']}:{info['trsvcid']} "
          f"({info['transport']}), controller {info['cntlid']}")
    print(f"  model {info['model']!r}, serial {info['serial']!r}, firmware {info['firmware']!r}")
    if path_lines:
        print("  paths (ANA state per namespace; * where I/O goes):")
        for line in path_lines:
            print(f"    +- {line}")
    print(f"  {info['io_queues']} I/O queue(s) of depth {info['queue_size']}, max transfer "
          f"{human_size(info['max_transfer'])}, in-capsule data {info['inline_data']} B")
    if info["authentication"]:
        print(f"  authenticated every queue with DH-HMAC-CHAP ({info['authentication']})")
    for ns in info["namespaces"]:
        ro = ", read-only" if ns["read_only"] else ""
        print(f"  namespace {ns['nsid']}: {human_size(ns['size'])} ({ns['blocks']} blocks of "
              f"{ns['block_size']} B{ro})")
    print("disconnected")
    return 0


def cmd_identify(args: argparse.Namespace) -> int:
    with Controller(options(args, args.nqn)).connect() as ctrl:
        ident = ctrl.identify
        assert ident is not None
        fields = {f: getattr(ident, f) for f in ident.__dataclass_fields__}
        namespaces = {}
        for nsid, ns in ctrl.namespaces.items():
            if args.namespace_id is not None and nsid != args.namespace_id:
                continue
            nsf = ns.identify
            assert nsf is not None
            namespaces[nsid] = {f: getattr(nsf, f) for f in nsf.__dataclass_fields__}
        if args.namespace_id is not None and args.namespace_id not in namespaces:
            raise NvmeError(f"namespace {args.namespace_id}", 0x00B, True)
    if args.output_format == "json":
        json.dump({"controller": fields, "namespaces": namespaces}, sys.stdout, indent=2,
                  default=_jsonable)
        print()
        return 0
    print("NVME Identify Controller:")
    for key, value in fields.items():
        print(f"{key:9}: {_show(value)}")
    for nsid, ns_fields in namespaces.items():
        print(f"\nNVME Identify Namespace {nsid}:")
        for key, value in ns_fields.items():
            print(f"{key:9}: {_show(value)}")
    return 0


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.hex()
    if hasattr(value, "__dataclass_fields__"):
        return {f: getattr(value, f) for f in value.__dataclass_fields__}
    if isinstance(value, tuple):
        return list(value)
    return str(value)


def _show(value: Any) -> str:
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:#x}" if value > 9 else str(value)
    return str(value)
