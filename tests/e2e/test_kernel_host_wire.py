"""What the Linux kernel's NVMe-oF host sends, replayed against our target over the soft
provider: each case here was seen in the lab (tests/lab/interop.sh, `nvme connect -t rdma`
against blockfabric-target on rxe) and failed there before it was fixed."""

from __future__ import annotations

import pytest

from blockfabric.initiator.host import NvmeError, connect
from blockfabric.protocol import StatusCode
from blockfabric.protocol.io import DatasetManagement, DSMRange

from .conftest import HOSTNQN, NQN, addr_of, free_port, ram_config, via

PAGE = 4096


@pytest.fixture
def ctrl(start_target):
    port = free_port()
    start_target(ram_config(port, namespaces=[
        {"nsid": 1, "backend": "ramdisk", "size": "4MiB", "block_size": 512}]))
    with connect(addr_of(), NQN, port, **via(), hostnqn=HOSTNQN,
                 nr_io_queues=1) as c:
        yield c


def _dsm_payload(slba: int, nlb: int, length: int) -> bytes:
    return DSMRange(0, nlb, slba).pack().ljust(length, b"\0")


@pytest.mark.parametrize("inline", [True, False], ids=["in-capsule", "keyed"])
def test_discard_with_one_range_in_a_whole_page(ctrl, inline):
    """blkdiscard: the 6.1 host sends one DSM range in a 4096-byte payload (SGL length 4096
    for NR 0).  nvmet takes any SGL at least as long as the ranges; we answered 0x00F."""
    ns = ctrl.namespaces[1]
    ns.write(0, b"\xa5" * 65536)
    sqe = DatasetManagement(nsid=1, nr=0, ad=True).to_sqe()
    ctrl.wait(ctrl.io_queue(), sqe, "Dataset Management",
              data_out=_dsm_payload(0, 32, PAGE), inline=inline)
    assert ns.read(0, 16384) == bytes(16384)                # 32 blocks of 512 B deallocated
    assert ns.read(16384, 16384) == b"\xa5" * 16384         # the rest untouched


def test_discard_with_a_payload_shorter_than_its_ranges_is_refused(ctrl):
    """The other side of nvmet's rule: fewer bytes than NR+1 ranges is 0x00F with DNR."""
    sqe = DatasetManagement(nsid=1, nr=1, ad=True).to_sqe()
    with pytest.raises(NvmeError) as err:
        ctrl.wait(ctrl.io_queue(), sqe, "Dataset Management",
                  data_out=_dsm_payload(0, 8, 16), inline=True)
    assert (err.value.status, err.value.dnr) == (StatusCode.SGL_DATA_LENGTH_INVALID, True)
