"""``blockfabric-target`` that ends a failed authentication the way Linux nvmet may.

nvmet (drivers/nvme/target/fabrics-cmd-auth.c, nvmet_execute_auth_receive) calls
nvmet_ctrl_fatal_error() *before* nvmet_req_complete() for the Authentication Receive that
carries Failure1, so the controller's queues may be disconnected before that message reaches
the host.  In the lab (tests/lab/interop.sh, B/auth-wrong-secret) the disconnect won.

Same command line as ``blockfabric-target``.  With NVMET_LIKE=end (the default) the Receive
that would carry Failure1 is never answered and the controller is destroyed, its queues
disconnected; with NVMET_LIKE=silent it is never answered and nothing else happens (a
controller that hangs).
"""

from __future__ import annotations

import logging
import os
import sys

from blockfabric.protocol import auth as dhchap
from blockfabric.protocol.opcodes import FabricsType
from blockfabric.target import controller as target_controller

log = logging.getLogger("nvmet-like")
MODE = os.environ.get("NVMET_LIKE", "end")
_auth_command = target_controller.Controller._auth_command


def _nvmet_like(self, cmd, auth):
    if cmd.sqe.fctype == FabricsType.AUTH_RECEIVE and auth.step == dhchap.AuthMsg.FAILURE1:
        if MODE == "end":
            log.info("nvmet-like: controller ended before Failure1 was sent")
            self.owner.destroy_controller(self, "authentication failed")
        else:
            log.info("nvmet-like: Authentication Receive for Failure1 left unanswered")
        return
    _auth_command(self, cmd, auth)


target_controller.Controller._auth_command = _nvmet_like

if __name__ == "__main__":
    from blockfabric.target.cli import main
    sys.exit(main())
