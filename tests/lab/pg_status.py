"""Where a poll-group target serves its I/O queues, from its control socket
(tests/lab/pollgroups.sh).

pg_status.py SOCKET                 print "c1.q1:g1 c1.q2:g0 | g0=1@PID g1=1@PID" (controller
                                    1's queue 1 -> group 1...; each group's I/O queues and pid)
pg_status.py SOCKET worker [SEC]    wait until the worker (group 1) serves an I/O queue
pg_status.py SOCKET empty [SEC]     wait until no controller is left and the worker has no queue
pg_status.py SOCKET queues N [SEC]  wait until N I/O queues are connected (all controllers':
                                    bench --numjobs J -i Q connects J controllers, J*Q queues)
Waits exit 1 (printing the last placement) when the time runs out.
"""
import sys
import time

from blockfabric.target.control import ControlError, request


def placement(sock: str) -> tuple[str, dict]:
    try:
        s = request(sock, "status")
    except ControlError as exc:
        return f"(no status: {exc})", {}
    queues = [(c["cntlid"], q["qid"], q.get("group", 0)) for c in s["controllers"]
              for q in c["queues"] if q["qid"]]
    groups = {g["index"]: g for g in s.get("groups", [])}
    text = " ".join(f"c{c}.q{qid}:g{g}" for c, qid, g in queues) + " | " + " ".join(
        f"g{i}={g['queues']}@{g['pid']}" for i, g in sorted(groups.items()))
    return text, {"queues": queues, "groups": groups, "controllers": len(s["controllers"])}


def main() -> int:
    sock, what = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None
    if what is None:
        print(placement(sock)[0])
        return 0
    want = int(sys.argv[3]) if what == "queues" else None
    at = 4 if what == "queues" else 3
    limit = float(sys.argv[at]) if len(sys.argv) > at else 30
    deadline = time.monotonic() + limit
    while True:
        text, st = placement(sock)
        if st:
            g1 = st["groups"].get(1, {}).get("queues", 0)
            if (what == "worker" and any(g == 1 for _c, _q, g in st["queues"])) \
                    or (what == "empty" and not st["controllers"] and not g1) \
                    or (what == "queues" and len(st["queues"]) == want):
                print(text)
                return 0
        if time.monotonic() > deadline:
            print(f"timed out waiting for {what}: {text}")
            return 1
        time.sleep(0.2)


if __name__ == "__main__":
    sys.exit(main())
