"""``blockfabric-target`` for the interop lab, with a probe on the data path.

Same command line as ``blockfabric-target``.  The probe only observes: it logs, at INFO, every
command whose data arrived in the capsule (an offset SGL) rather than by RDMA READ, so that
tests/lab/interop.sh can show that the kernel host's 4 KiB write really travelled in-capsule.
"""

from __future__ import annotations

import logging
import sys

from blockfabric.fabric import target_side

log = logging.getLogger("interop.probe")
_take_inline = target_side.TargetQueue.take_inline


def _probed_take_inline(self, cmd, dest, at, length):
    # Every in-capsule copy goes through take_inline (a Read/Write's straight into the
    # volume, anything else's through fetch).
    log.info("probe: qid %d cid %d opcode %#04x: %d bytes of in-capsule data", self.qid,
             cmd.cid, cmd.opcode, cmd.data_length)
    return _take_inline(self, cmd, dest, at, length)


target_side.TargetQueue.take_inline = _probed_take_inline

if __name__ == "__main__":
    from blockfabric.target.cli import main
    sys.exit(main())
