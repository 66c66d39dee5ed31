"""The fast Read/Write layout (protocol.rw) says exactly what SQE and ReadWrite say."""

from __future__ import annotations

from hypothesis import given, strategies as st

from blockfabric.protocol import SQE, KeyedSGL, OffsetSGL, ReadWrite
from blockfabric.protocol.opcodes import IOOpcode
from blockfabric.protocol.rw import keyed_word, offset_word, pack_rw_into, unpack_rw
from tests.protocol.helpers import FAST

u16, u32, u64 = (st.integers(0, (1 << b) - 1) for b in (16, 32, 64))
keyed = st.builds(KeyedSGL, u64, st.integers(0, (1 << 24) - 1), u32, st.booleans())
offset = st.builds(OffsetSGL, st.just(0), u32)


@FAST
@given(st.sampled_from([IOOpcode.READ, IOOpcode.WRITE]), u16, u32, u64, u16, u16,
       st.one_of(keyed, offset))
def test_pack_is_the_sqe_of_readwrite(opcode, cid, nsid, slba, nlb, control, sgl) -> None:
    fast = bytearray(64)
    word = (offset_word(sgl.length) if isinstance(sgl, OffsetSGL)
            else keyed_word(sgl.length, sgl.key, sgl.invalidate))
    pack_rw_into(fast, opcode, cid, nsid, slba, nlb, sgl.offset if isinstance(
        sgl, OffsetSGL) else sgl.addr, word, control)
    slow = bytearray(64)
    ReadWrite(opcode, nsid, slba, nlb, control).to_sqe(cid, sgl).pack_into(slow)
    assert fast == slow
    sqe = SQE.unpack_from(fast)
    assert sqe.sgl == sgl and sqe.cid == cid
    op, flags, cid2, nsid2, addr, word2, slba2, cdw12 = unpack_rw(fast)
    assert (op, cid2, nsid2, slba2, cdw12 & 0xFFFF, cdw12 >> 16, word2) == \
        (opcode, cid, nsid, slba, nlb, control, word)
    assert flags == sqe.flags
