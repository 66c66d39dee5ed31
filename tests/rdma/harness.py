"""What the contract tests hold: a World (two agents and an address) and connected Ends."""

from __future__ import annotations

from dataclasses import dataclass

from blockfabric.rdma import Access, SendFlags, WrOpcode

RW = int(Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ)
LOCAL = int(Access.LOCAL_WRITE)
SIGNALED = int(SendFlags.SIGNALED)


@dataclass
class Mr:
    """What a test knows of a registered region (possibly in another process)."""

    mid: int
    addr: int
    length: int
    lkey: int
    rkey: int
    access: int

    def sge(self, off: int = 0, length: int | None = None) -> list:
        return [self.mid, off, self.length - off if length is None else length]


def wr(opcode: WrOpcode, wr_id: int = 0, sges: list = (), remote: Mr | None = None,
       off: int = 0, flags: int = SIGNALED, **extra) -> dict:
    """A send WR as plain data; ``remote``+``off`` fill remote_addr and rkey."""
    out = {"wr_id": wr_id, "opcode": int(opcode), "sges": list(sges), "flags": int(flags)}
    if remote is not None:
        out["remote_addr"] = remote.addr + off
        out["rkey"] = remote.rkey
    out.update(extra)
    return out


class End:
    """One end of a connection, whatever process or namespace it lives in."""

    def __init__(self, agent, cid: int) -> None:
        self.agent = agent
        self.cid = cid

    def _call(self, op: str, **kw):
        return self.agent.call(op, cid=self.cid, **kw)

    def reg(self, size: int, access: int = RW, seed: int | None = None,
            kind: str = "bytearray") -> Mr:
        reply = self._call("reg", size=size, access=int(access), seed=seed, kind=kind)
        if "rdma_error" in reply:
            raise AssertionError(f"reg_mr failed: {reply}")
        return Mr(**reply)

    def send(self, *wrs: dict) -> dict:
        return self._call("post_send", wrs=list(wrs))

    def recv(self, *wrs: dict) -> dict:
        return self._call("post_recv", wrs=list(wrs))

    def poll(self, cq: str = "send", n: int = 1, timeout: float = 5.0) -> list[dict]:
        return self._call("poll", cq=cq, n=n, timeout=timeout)

    def state(self) -> int:
        return self._call("state")

    def event(self, timeout: float = 3.0):
        return self._call("event", timeout=timeout)

    def disconnect(self) -> None:
        self._call("disconnect")

    def info(self) -> dict:
        return self._call("qp_info")

    def digest(self, mr: Mr, off: int = 0, n: int | None = None) -> str:
        return self.agent.call("digest", mid=mr.mid, off=off, n=n)

    def read(self, mr: Mr, off: int, n: int) -> bytes:
        return bytes.fromhex(self.agent.call("read", mid=mr.mid, off=off, n=n))

    def write(self, mr: Mr, off: int, data: bytes) -> None:
        self.agent.call("write", mid=mr.mid, off=off, data=data.hex())

    def fill(self, mr: Mr, seed: int) -> None:
        self.agent.call("fill", mid=mr.mid, seed=seed)

    def dereg(self, mr: Mr) -> None:
        self.agent.call("dereg", mid=mr.mid)


def recv_wr(wr_id: int, *sges: list) -> dict:
    return {"wr_id": wr_id, "sges": list(sges)}


class World:
    """Two agents (A active, B passive) and the address B listens on."""

    def __init__(self, name: str, a, b, address: str, address6: str | None = None) -> None:
        self.name, self.a, self.b = name, a, b
        self.provider = name.split("-", 1)[0]
        self.address = address
        self.address6 = address6

    def connect(self, private_data: bytes = b"", accept_data: bytes = b"",
                reject: bool = False, cap_a: dict | None = None, cap_b: dict | None = None,
                rnr_retry: int = 7, rnr_retry_b: int = 7, sig_all: bool = False,
                address: str | None = None) -> tuple[End, End] | dict:
        """Connect A to B.  Returns the two ends, or A's result dict when it did not connect
        (rejected, error); the passive side's view is in ``self.last_request``."""
        address = address or self.address
        lst = self.b.call("listen", address=address)
        token = self.a.call("connect_start", address=address, port=lst["port"],
                            private_data=private_data.hex(), cap=cap_a, sig_all=sig_all,
                            rnr_retry=rnr_retry)["token"]
        self.last_request = self.b.call("accept", lid=lst["lid"], private_data=accept_data.hex(),
                                        reject=reject, cap=cap_b, rnr_retry=rnr_retry_b)
        result = self.a.call("connect_wait", token=token)
        if "cid" not in result:
            return result
        self.last_reply = bytes.fromhex(result["private_data"])
        return End(self.a, result["cid"]), End(self.b, self.last_request["cid"])

    def reset(self) -> None:
        for agent in (self.a, self.b):
            agent.call("reset")
