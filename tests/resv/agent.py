"""One host of a reservation test, in its own process (and network namespace): it connects
with its own host NQN and host ID, then runs JSON commands from stdin, one per line, and
answers each with one JSON line on stdout ({"ok": ...} or {"status": <NVMe status>}).

Commands: register/acquire/release (the blockfabric.initiator.resv arguments), report,
probe (a 4 KiB read and write at ``lba``: the status of each, 0 = allowed), read
(``lba``, ``blocks``: their SHA-256), hammer (write the ``blocks`` blocks at ``lba`` over and
over, ``size`` blocks a command, ``depth`` in flight, stamped with this host and a sequence
number),
stop (end the hammer once every write in flight has answered: counts), identify (this
controller's cntlid and Identify Controller CMIC), log (a reservation notification log
entry), quit.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import struct
import sys
import threading
import uuid

BS = 4096


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--netns")
    ap.add_argument("--traddr", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--nqn", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--transport", choices=("rdma", "tcp"), default="rdma")
    args = ap.parse_args()
    if args.netns:
        from blockfabric.net import enter_netns
        enter_netns(args.netns)
    from blockfabric.initiator import resv
    from blockfabric.initiator.host import ConnectOptions, Controller, NvmeError

    hostid = uuid.uuid5(uuid.NAMESPACE_DNS, args.name)
    ctrl = Controller(ConnectOptions(
        traddr=args.traddr, trsvcid=args.port, subnqn=args.nqn,
        **({"transport": "tcp"} if args.transport == "tcp" else {"provider": "soft"}),
        hostnqn=f"nqn.2014-08.org.nvmexpress:uuid:{hostid}", hostid=hostid.bytes,
        nr_io_queues=2, keep_alive_tmo=5, reconnect_delay=0.5, ctrl_loss_tmo=30)).connect()
    ns = ctrl.namespaces[1]
    print(json.dumps({"connected": ctrl.cntlid}), flush=True)
    tag = args.name.encode()[:8].ljust(8, b"\0")
    hammer: dict = {}

    def status_of(call) -> int:
        try:
            call()
            return 0
        except NvmeError as exc:
            return int(exc.status)

    def start_hammer(lba: int, blocks: int, depth: int, size: int) -> None:
        state = {"ok": 0, "conflicts": 0, "other": 0, "seq": 0, "inflight": 0,
                 "stop": False}
        cond = threading.Condition()
        hammer.update(state=state, cond=cond)

        def issue() -> None:
            with cond:
                if state["stop"]:
                    return
                state["seq"] += 1
                seq = state["seq"]
                state["inflight"] += 1
            block = lba + seq * size % blocks
            data = (tag + struct.pack("<Q", seq)) * (size * BS // 16)
            fut = ns.submit_write(block * BS, data)
            fut.add_done_callback(done)

        def done(fut) -> None:
            exc = fut.exception()
            with cond:
                state["inflight"] -= 1
                if exc is None:
                    state["ok"] += 1
                elif isinstance(exc, NvmeError) and exc.status == resv.CONFLICT:
                    state["conflicts"] += 1
                else:
                    state["other"] += 1
                    state["error"] = str(exc)
                if state["conflicts"] >= 8:
                    state["stop"] = True         # fenced: stop sending
                cond.notify_all()
            threading.Thread(target=issue, daemon=True).start()

        for _ in range(depth):
            issue()

    def stop_hammer() -> dict:
        state, cond = hammer["state"], hammer["cond"]
        with cond:
            state["stop"] = True
            cond.wait_for(lambda: state["inflight"] == 0, timeout=30)
            return {k: v for k, v in state.items() if k != "stop"}

    for line in sys.stdin:
        req = json.loads(line)
        op = req.pop("op")
        try:
            if op == "register":
                out = {"status": status_of(lambda: resv.register(ns, **req))}
            elif op == "acquire":
                out = {"status": status_of(lambda: resv.acquire(ns, **req))}
            elif op == "release":
                out = {"status": status_of(lambda: resv.release(ns, **req))}
            elif op == "report":
                out = {"status": 0, "report": resv.report(ns).as_dict()}
            elif op == "probe":
                at = req["lba"] * BS
                out = {"read": status_of(lambda: ns.read(at, BS)),
                       "write": status_of(lambda: ns.write(at, bytes(BS)))}
            elif op == "read":
                data = ns.read(req["lba"] * BS, req["blocks"] * BS)
                out = {"sha256": hashlib.sha256(data).hexdigest()}
            elif op == "hammer":
                start_hammer(req["lba"], req["blocks"], req["depth"], req.get("size", 1))
                out = {"started": True}
            elif op == "wait_hammer":
                state, cond = hammer["state"], hammer["cond"]
                with cond:
                    cond.wait_for(lambda: state["ok"] >= req["ok"], timeout=30)
                    out = {"ok": state["ok"]}
            elif op == "stop":
                out = stop_hammer()
            elif op == "identify":
                out = {"cntlid": ctrl.cntlid, "cmic": ctrl.identify.cmic}
            elif op == "log":
                out = resv.notification_log(ctrl).as_dict()
            elif op == "quit":
                print(json.dumps({"bye": True}), flush=True)
                break
            else:
                out = {"error": f"unknown op {op}"}
        except Exception as exc:            # the test sees it, the agent goes on
            out = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(out), flush=True)
    ctrl.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
