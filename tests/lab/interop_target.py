"""``blockfabric-target`` for the interop lab, with a probe on the data path.

Same command line as ``blockfabric-target``.  The probe only observes: it logs, at INFO, every
command whose data arrived in the capsule (an offset SGL) rather than by RDMA READ, so that
tests/lab/interop.sh can show that the kernel host's 4 KiB write really travelled in-capsule.
"""

from __future__ import annotations

import logging
import sys

from blockfabric.fabric import target_side
from blockfabric.protocol import OffsetSGL

log = logging.getLogger("interop.probe")
_fetch = target_side.TargetQueue.fetch


def _probed_fetch(self, cmd, view, sge, done):
    if isinstance(cmd.sgl, OffsetSGL):
        log.info("probe: qid %d cid %d opcode %#04x: %d bytes of in-capsule data", self.qid,
                 cmd.cid, cmd.sqe.opcode, cmd.sgl.length)
    return _fetch(self, cmd, view, sge, done)


target_side.TargetQueue.fetch = _probed_fetch

if __name__ == "__main__":
    from blockfabric.target.cli import main
    sys.exit(main())
