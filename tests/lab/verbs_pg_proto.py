"""Prototype (issue 19 item 1): an rdma_cm connection whose QP lives in another process.

The parent keeps the passive rdma_cm id (no QP), reads INIT/RTR/RTS attributes with
rdma_init_qp_attr and sends them to a spawned child, which opens the same device, creates its
QP (own PD, CQ, MR), moves it with ibv_modify_qp and reports its qp_num; the parent accepts
with a ConnParam naming that qp_num.  A client (a thread here) then does an RDMA WRITE and a
SEND into the child, which answers with a SEND; the client's disconnect reaches the parent's
event channel and is forwarded to the child.  Usage: verbs_pg_proto.py [IP]; rc 0 = it works.
"""
import multiprocessing as mp
import sys
import threading
import time
import struct
from blockfabric.rdma import SGE, Access, RecvWR, SendWR, WrOpcode, CMEventType, get_provider

IP = sys.argv[1] if len(sys.argv) > 1 else "10.99.0.1"
SCALARS = ("qp_state", "path_mtu", "qp_access_flags", "pkey_index", "port_num", "dest_qp_num",
           "rq_psn", "sq_psn", "max_dest_rd_atomic", "max_rd_atomic", "min_rnr_timer",
           "timeout", "retry_cnt", "rnr_retry", "qkey")
AH = ("dlid", "sl", "src_path_bits", "static_rate", "is_global", "port_num")
GR = ("flow_label", "sgid_index", "hop_limit", "traffic_class")


def dump(attr, mask):
    ah = attr.ah_attr
    return ({k: getattr(attr, k) for k in SCALARS},
            {k: getattr(ah, k) for k in AH + GR} | {"dgid": str(ah.dgid)}, mask)


def load(fields, ah, mask):
    from pyverbs.qp import QPAttr
    from pyverbs.addr import AHAttr, GlobalRoute, GID
    attr = QPAttr()
    for k, v in fields.items():
        setattr(attr, k, v)
    if ah["is_global"]:
        gr = GlobalRoute(dgid=GID(ah["dgid"]), **{k: ah[k] for k in GR})
        attr.ah_attr = AHAttr(gr=gr, **{k: ah[k] for k in AH})
    return attr, mask


def child(conn, dev):
    from pyverbs.device import Context
    from pyverbs.pd import PD
    from pyverbs.cq import CQ
    from pyverbs.mr import MR
    from pyverbs.qp import QP, QPInitAttr, QPCap, QPAttr
    from pyverbs.wr import RecvWR as RW, SendWR as SW, SGE as S
    import pyverbs.enums as e
    ctx = Context(name=dev); pd = PD(ctx); cq = CQ(ctx, 16)
    qp = QP(pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=cq, rcq=cq, cap=QPCap(4, 4, 1, 1)))
    mr = MR(pd, 4096, e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE)
    init, rtr, rts = conn.recv()
    qp.modify(*load(*init))
    qp.post_recv(RW(wr_id=1, num_sge=1, sg=[S(mr.buf, 64, mr.lkey)]))
    qp.modify(*load(*rtr)); qp.modify(*load(*rts))
    conn.send((qp.qp_num, mr.buf, mr.rkey))
    wc = poll(cq)
    got, written = mr.read(5, 0), mr.read(5, 2048)
    mr.write(b"pong!", 5, 1024)
    qp.post_send(SW(wr_id=2, opcode=e.IBV_WR_SEND, num_sge=1, sg=[S(mr.buf + 1024, 5, mr.lkey)],
                    send_flags=e.IBV_SEND_SIGNALED))
    wc2 = poll(cq)
    conn.send((wc.status, got, written, wc2.status))
    assert conn.recv() == "disconnected"        # forwarded by the parent from its channel
    qp.post_recv(RW(wr_id=3, num_sge=1, sg=[S(mr.buf, 64, mr.lkey)]))
    qp.modify(QPAttr(qp_state=e.IBV_QPS_ERR), e.IBV_QP_STATE)
    conn.send(("flushed", poll(cq).status))


def poll(cq, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        n, wcs = cq.poll(1)
        if n:
            return wcs[0]
        time.sleep(0.001)
    raise TimeoutError("no completion")


def client(port, out):
    p = get_provider("verbs"); c = p.create_id(); c.resolve(IP, port)
    pd = c.context.alloc_pd(); cq = c.context.create_cq(16)
    mr = pd.reg_mr(bytearray(4096), Access.LOCAL_WRITE)
    qp = c.create_qp(pd, cq, cq)
    qp.post_recv(RecvWR(1, [SGE(mr.addr, 64, mr.lkey)]))
    addr, rkey = struct.unpack_from("<QI", c.connect(b"hello", timeout=20))
    mr.buf[100:105] = b"WRITE"; mr.buf[200:205] = b"ping!"
    qp.post_send([SendWR(2, WrOpcode.RDMA_WRITE, [SGE(mr.addr + 100, 5, mr.lkey)],
                         remote_addr=addr + 2048, rkey=rkey),
                  SendWR(3, WrOpcode.SEND, [SGE(mr.addr + 200, 5, mr.lkey)])])
    wcs = []
    while len(wcs) < 3:
        wcs += cq.poll(4)
    out["client"] = ([w.status.name for w in wcs], bytes(mr.buf[:5]))
    c.disconnect()


if __name__ == "__main__":
    def recv(conn, timeout=30):
        if not conn.poll(timeout):
            raise TimeoutError("child did not answer")
        return conn.recv()
    prov = get_provider("verbs")
    lst = prov.listen(IP, 0)
    out = {}
    t = threading.Thread(target=client, args=(lst.local_address[1], out)); t.start()
    cmid = lst.get_request(20)
    pv = cmid._pv
    attrs = [dump(*cmid._cm.init_qp_attr(s)) for s in (pv.e.IBV_QPS_INIT, pv.e.IBV_QPS_RTR, pv.e.IBV_QPS_RTS)]
    print("attrs from rdma_init_qp_attr:", attrs, flush=True)
    parent, theirs = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=child, args=(theirs, cmid.context.name)); proc.start()
    parent.send(attrs)
    qp_num, addr, rkey = recv(parent)
    print(f"child QP {qp_num:#x} (pid {proc.pid}); accepting with ConnParam(qp_num=...)", flush=True)
    param = pv.cmid.ConnParam(resources=1, depth=1, qp_num=qp_num, data_len=12)
    param.set_private_data(struct.pack("<QI", addr, rkey))
    cmid._cm.accept(param)
    print("child saw (recv status, SEND data, WRITE data, send status):", parent.recv(), flush=True)
    ev = cmid.get_event(20)
    print("coordinator event:", ev and ev.type.name, flush=True)
    parent.send("disconnected")
    print("child after forwarded disconnect:", parent.recv(), flush=True)
    t.join(20); proc.join(20)
    print("client:", out.get("client"), flush=True)
    ok = out.get("client") == (["SUCCESS"] * 3, b"pong!") and ev and ev.type == CMEventType.DISCONNECTED
    print("PROTOTYPE", "OK" if ok else "FAILED"); cmid.close(); lst.close()
    sys.exit(0 if ok else 1)
