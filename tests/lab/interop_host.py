"""A verify workload through blockfabric's host library against any NVMe-oF RDMA target.

Runs inside the lab guest against the kernel's nvmet-rdma (tests/lab/interop.sh, case B):
writes seeded random data in many sizes at many offsets with several commands in flight
on every I/O queue, reads it all back and compares, flushes, discards, and (with
--check-device) compares the target's own backing device byte for byte, so a success here
is the kernel target agreeing with our wire format, not our host agreeing with itself.
With --dhchap-secret (and --dhchap-ctrl-secret) every queue first authenticates with
DH-HMAC-CHAP, and ``authenticated: N queue(s) ...`` says how.
Prints ``verified: N bytes ...``; exit status 0 only when every byte matched.
"""

from __future__ import annotations

import argparse
import mmap
import os
import random
import sys
import time

from blockfabric.initiator.host import connect


def read_direct(path: str, length: int) -> bytes:
    """Read with O_DIRECT: the page cache of /dev/ram0 does not see what nvmet wrote."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        buf = mmap.mmap(-1, length)             # page aligned, as O_DIRECT wants
        got = os.preadv(fd, [buf], 0)
        return bytes(buf[:got])
    finally:
        os.close(fd)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traddr", required=True)
    ap.add_argument("--trsvcid", type=int, default=4420)
    ap.add_argument("--nqn", required=True)
    ap.add_argument("--hostnqn")
    ap.add_argument("--nsid", type=int, default=1)
    ap.add_argument("--queues", type=int, default=2)
    ap.add_argument("--span", type=int, default=16 << 20, help="bytes of the namespace to use")
    ap.add_argument("--check-device", help="the target's backing device, compared at the end")
    ap.add_argument("--seed", type=int, default=20261209)
    ap.add_argument("--dhchap-secret", help="the host's DH-HMAC-CHAP secret (DHHC-1:...)")
    ap.add_argument("--dhchap-ctrl-secret", help="the controller's, to authenticate it too")
    ap.add_argument("--transport", choices=("rdma", "tcp"), default="rdma",
                    help="rdma: the verbs provider; tcp: NVMe/TCP (tests/lab/tcp.sh)")
    ap.add_argument("--digests", action="store_true", help="NVMe/TCP header and data digests")
    args = ap.parse_args()
    how = {"transport": "tcp", "hdr_digest": args.digests, "data_digest": args.digests} \
        if args.transport == "tcp" else {"provider": "verbs"}
    rng = random.Random(args.seed)
    t0 = time.monotonic()
    with connect(args.traddr, args.nqn, args.trsvcid, hostnqn=args.hostnqn,
                 **how, nr_io_queues=args.queues, dhchap_secret=args.dhchap_secret,
                 dhchap_ctrl_secret=args.dhchap_ctrl_secret) as ctrl:
        ns = ctrl.namespaces[args.nsid]
        bs = ns.block_size
        span = min(args.span, ns.size)
        print(f"connected: cntlid {ctrl.cntlid}, {len(ctrl.io_queues)} I/O queues, "
              f"nsid {ns.nsid}: {ns.size} bytes, {bs}-byte blocks, "
              f"model {ctrl.identify.mn!r}")
        if ctrl.authenticated:
            print(f"authenticated: {len(ctrl.authenticated)} queue(s) (qids "
                  f"{sorted(ctrl.authenticated)}): {ctrl.authenticated[0]}")
        image = bytearray(span)
        # Writes: sizes from one block to 1 MiB (the kernel target's MDTS), ten in flight.
        # The first pass covers the span sequentially so every byte is known; then random
        # overwrites of various sizes land on top of it.
        pending: list = []
        extents = [(off, min(1 << 20, span - off)) for off in range(0, span, 1 << 20)]
        for _ in range(200):
            nblocks = rng.choice((1, 2, 7, 8, 33, 256))
            length = min(nblocks * bs, span)
            off = rng.randrange(0, span - length + 1, bs)
            extents.append((off, length))
        written = 0
        for off, length in extents:
            # Commands in flight have no order between them: an overlapping write waits.
            for p_off, p_len, fut in pending:
                if p_off < off + length and off < p_off + p_len:
                    fut.result()
            pending = [p for p in pending if not p[2].done()]
            while len(pending) >= 10:
                pending.pop(0)[2].result()
            data = rng.randbytes(length)
            image[off:off + length] = data
            pending.append((off, length, ns.submit_write(off, data)))
            written += length
        for _, _, fut in pending:
            fut.result()
        ns.flush()
        # Reads: back in chunks of various sizes, several in flight.
        reads, off = [], 0
        while off < span:
            length = min(rng.choice((bs, 4096, 65536, 1 << 20)), span - off)
            length -= length % bs
            reads.append((off, ns.submit_read(off, length)))
            off += length
        bad = [o for o, fut in reads if fut.result() != image[o:o + len(fut.result())]]
        if bad:
            print(f"MISMATCH at {len(bad)} read(s), first at offset {bad[0]}")
            return 1
        print(f"verified: {span} bytes read back equal to what was written "
              f"({written} bytes in {len(extents)} writes)")
        if args.check_device:
            on_dev = read_direct(args.check_device, span)
            if on_dev != image:
                print(f"MISMATCH: {args.check_device} differs from what was written")
                return 1
            print(f"verified: {span} bytes on {args.check_device} (the target's own "
                  f"backing store) equal to what was written")
        # Dataset Management (deallocate) must be accepted.  What it leaves behind is the
        # device's business: brd in 6.1 has no discard and nvmet then ignores it.
        ns.discard(0, 1 << 20)
        print("discard: Dataset Management of 1 MiB accepted")
    print(f"elapsed {time.monotonic() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
