"""The peer process of the contract tests: ``python -m tests.rdma.peer``.

Serves one agent over stdin/stdout (JSON lines) and dies with its parent: on EOF, and by
PR_SET_PDEATHSIG if the parent is killed.
"""

from __future__ import annotations

import argparse
import ctypes
import signal
import sys

from .agent import AgentCore, serve

PR_SET_PDEATHSIG = 1


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--provider", default="soft")
    parser.add_argument("--progress", default=None)
    parser.add_argument("--netns", default=None)
    parser.add_argument("--shm", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--shared", action="store_true")
    args = parser.parse_args()
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if args.netns:
        from blockfabric.net import enter_netns
        enter_netns(args.netns)
    serve(AgentCore(args.provider, args.progress, args.shm, args.shared), sys.stdin,
          sys.stdout)


if __name__ == "__main__":
    main()
