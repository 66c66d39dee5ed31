"""Reservations from the host: the library API and ``blockfabric resv ...``.

Library::

    from blockfabric.initiator.resv import register, acquire, release, report
    with Controller(opts).connect() as ctrl:
        ns = ctrl.namespaces[1]
        register(ns, nrkey=0xA1)                        # RREGA 0
        acquire(ns, crkey=0xA1, rtype=1)                 # write exclusive
        print(report(ns).as_dict())
        release(ns, crkey=0xA1, rtype=1)

A refused command raises :class:`~blockfabric.initiator.host.NvmeError` with the target's
status: 0x83 (``RESERVATION_CONFLICT``) when the host's key or role does not allow it.
Reservation commands change state, so they are sent once, on an I/O queue, and are not
re-issued after a reconnect (unlike reads and writes): a command whose queue died raises
QueueDead, and ``report`` tells what happened.

The command line takes nvme-cli's flag names (``nvme resv-register`` and friends); where a
resv flag's short letter is a connection flag's (-a, -n, -t, -c, -k, -i), the connection flag
is long only (--traddr, --nqn, ...).
"""

from __future__ import annotations

import argparse
import json
import sys

from blockfabric.initiator.host import Controller, HostNamespace, NvmeError
from blockfabric.protocol import resv
from blockfabric.protocol.opcodes import AdminOpcode
from blockfabric.protocol.status import StatusCode

#: Reservation Conflict, as NvmeError.status carries it.
CONFLICT = StatusCode.RESERVATION_CONFLICT
REPORT_BYTES = 4096         # 63 registrants with EDS


def _send(ns: HostNamespace, what: str, sqe_and_data: tuple) -> None:
    sqe, data = sqe_and_data
    ctrl = ns.ctrl
    ctrl.wait(ctrl.io_queue(), sqe, what, data_out=data)


def register(ns: HostNamespace, nrkey: int = 0, crkey: int = 0, rrega: int = 0, *,
             iekey: bool = False, cptpl: int = 0) -> None:
    """Reservation Register: RREGA 0 register NRKEY, 1 unregister, 2 replace CRKEY by NRKEY;
    CPTPL 0 no change, 2 clear, 3 persist through power loss (a target restart)."""
    _send(ns, "Reservation Register",
          resv.register_sqe(ns.nsid, rrega, crkey, nrkey, iekey=iekey, cptpl=cptpl))


def acquire(ns: HostNamespace, crkey: int, rtype: int, racqa: int = 0, prkey: int = 0, *,
            iekey: bool = False) -> None:
    """Reservation Acquire: RACQA 0 acquire, 1 preempt PRKEY's holders/registrants, 2 preempt
    and abort (returns once none of their commands is in flight at the target)."""
    _send(ns, "Reservation Acquire",
          resv.acquire_sqe(ns.nsid, racqa, rtype, crkey, prkey, iekey=iekey))


def release(ns: HostNamespace, crkey: int, rtype: int = 0, rrela: int = 0, *,
            iekey: bool = False) -> None:
    """Reservation Release: RRELA 0 release (RTYPE must be the reservation's), 1 clear
    (every registration goes)."""
    _send(ns, "Reservation Release",
          resv.release_sqe(ns.nsid, rrela, rtype, crkey, iekey=iekey))


def report(ns: HostNamespace, eds: bool = True, length: int = REPORT_BYTES
           ) -> resv.ReservationStatus:
    """Reservation Report (the extended data structure: 128-bit host IDs)."""
    ctrl = ns.ctrl
    _, data = ctrl.wait(ctrl.io_queue(), resv.report_sqe(ns.nsid, length, eds),
                        "Reservation Report", data_in=length)
    return resv.ReservationStatus.unpack(data or b"", eds)


def notification_log(ctrl: Controller) -> resv.NotificationLog:
    """One entry of the reservation notification log (LID 0x80; each read takes one)."""
    return resv.NotificationLog.unpack(ctrl.get_log_page(resv.LID_RESV_NOTIFY, resv.LOG_ENTRY))


def _features(ctrl: Controller, set_: bool, fid: int, nsid: int, value: int = 0) -> int:
    from blockfabric.protocol.capsule import SQE
    sqe = SQE(opcode=AdminOpcode.SET_FEATURES if set_ else AdminOpcode.GET_FEATURES,
              nsid=nsid, cdw10=fid, cdw11=value)
    assert ctrl.admin is not None
    cqe, _ = ctrl.wait(ctrl.admin, sqe, f"{'Set' if set_ else 'Get'} Features {fid:#x}")
    return cqe.result & 0xFFFFFFFF


def set_notification_mask(ctrl: Controller, mask: int, nsid: int = 0xFFFFFFFF) -> None:
    """Set Features 0x82: bit 1 masks registration preempted, 2 released, 3 preempted."""
    _features(ctrl, True, resv.FID_RESV_MASK, nsid, mask)


def get_persistence(ctrl: Controller, nsid: int) -> bool:
    """Get Features 0x83: whether the namespace's reservations persist through power loss."""
    return bool(_features(ctrl, False, resv.FID_RESV_PERSIST, nsid) & 1)


# -- command line --------------------------------------------------------------------------
def _int(text: str) -> int:
    value = int(text, 0)
    if not 0 <= value < 1 << 64:
        raise argparse.ArgumentTypeError(f"{text!r}: not a 64-bit key")
    return value


def add_parsers(sub: argparse._SubParsersAction, formatter, add_connection_flags,
                add_output_format) -> None:
    """``resv register|acquire|release|report`` with nvme-cli's flags."""
    p = sub.add_parser("resv", help="persistent reservations (register, acquire, release, "
                                    "report), with nvme-cli's flags", formatter_class=formatter,
                       description="Send one reservation command to a namespace and print "
                                   "the answer. Fencing with reservations: docs/reservations.md.")
    rsub = p.add_subparsers(dest="resv_command", metavar="ACTION", required=True)

    def common(name: str, help_: str) -> argparse.ArgumentParser:
        q = rsub.add_parser(name, help=help_, formatter_class=formatter)
        add_connection_flags(q, short=False)
        q.add_argument("-n", "--namespace-id", type=int, default=1, metavar="NSID",
                       help="namespace (default 1)")
        add_output_format(q)
        return q

    q = common("register", "register, unregister or replace this host's key (resv-register)")
    q.add_argument("-c", "--crkey", type=_int, default=0, help="current reservation key")
    q.add_argument("-k", "--nrkey", type=_int, default=0, help="new reservation key")
    q.add_argument("-r", "--rrega", type=int, choices=(0, 1, 2), default=0,
                   help="0 register, 1 unregister, 2 replace")
    q.add_argument("-p", "--cptpl", type=int, choices=(0, 1, 2, 3), default=0,
                   help="change persist through power loss: 0 no change, 2 clear, 3 persist")
    q.add_argument("-i", "--iekey", action="store_true", help="ignore the existing key")
    q = common("acquire", "acquire or preempt a reservation (resv-acquire)")
    q.add_argument("-c", "--crkey", type=_int, default=0, help="current reservation key")
    q.add_argument("-p", "--prkey", type=_int, default=0, help="preempt reservation key")
    q.add_argument("-t", "--rtype", type=int, choices=range(1, 7), required=True,
                   help="1 write exclusive, 2 exclusive access, 3/4 the same for "
                        "registrants only, 5/6 for all registrants")
    q.add_argument("-a", "--racqa", type=int, choices=(0, 1, 2), default=0,
                   help="0 acquire, 1 preempt, 2 preempt and abort")
    q.add_argument("-i", "--iekey", action="store_true", help="ignore the existing key")
    q = common("release", "release or clear a reservation (resv-release)")
    q.add_argument("-c", "--crkey", type=_int, default=0, help="current reservation key")
    q.add_argument("-t", "--rtype", type=int, choices=range(0, 7), default=0,
                   help="the reservation's type (release)")
    q.add_argument("-a", "--rrela", type=int, choices=(0, 1), default=0,
                   help="0 release, 1 clear")
    q.add_argument("-i", "--iekey", action="store_true", help="ignore the existing key")
    q = common("report", "print the registrants and the reservation (resv-report)")
    q.add_argument("-d", "--numd", type=int, default=REPORT_BYTES // 4 - 1,
                   help="dwords to transfer, 0-based")
    q.add_argument("-e", "--eds", action="store_true", default=True,
                   help="extended data structure (128-bit host IDs; always used here)")


def cmd_resv(args: argparse.Namespace) -> int:
    from blockfabric.initiator.commands import options
    action = args.resv_command
    with Controller(options(args, args.nqn)).connect() as ctrl:
        ns = ctrl.namespaces.get(args.namespace_id)
        if ns is None:
            raise NvmeError(f"namespace {args.namespace_id}", StatusCode.INVALID_NS, True)
        if action == "register":
            register(ns, args.nrkey, args.crkey, args.rrega, iekey=args.iekey,
                     cptpl=args.cptpl)
        elif action == "acquire":
            acquire(ns, args.crkey, args.rtype, args.racqa, args.prkey, iekey=args.iekey)
        elif action == "release":
            release(ns, args.crkey, args.rtype, args.rrela, iekey=args.iekey)
        else:
            status = report(ns, True, 4 * (args.numd + 1))
    if action != "report":
        if args.output_format == "json":
            json.dump({"command": f"resv-{action}", "nsid": args.namespace_id,
                       "status": "success"}, sys.stdout)
            print()
        else:
            print(f"NVME Reservation {action} success")
        return 0
    if args.output_format == "json":
        json.dump(status.as_dict(), sys.stdout, indent=2)
        print()
        return 0
    print(f"\nNVME Reservation status:\n\ngen       : {status.gen}\n"
          f"rtype     : {status.rtype} ({resv.RTYPE_NAMES.get(status.rtype, '?')})\n"
          f"regctl    : {status.regctl}\nptpls     : {int(status.ptpls)}")
    for i, r in enumerate(status.registrants):
        print(f"regctlext[{i}] :\n  cntlid     : {r.cntlid:x}\n  rcsts      : {int(r.holder)}"
              f"\n  hostid     : {r.hostid.hex()}\n  rkey       : {r.rkey:x}")
    return 0
