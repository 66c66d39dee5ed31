"""blockfabric: NVMe-over-Fabrics style block storage over RDMA.

The shared core.  ``blockfabric.protocol`` is pure NVMe / NVMe-oF encoding with no I/O;
``blockfabric.rdma`` is the verbs interface and its providers; ``blockfabric.fabric`` is the
NVMe-oF RDMA queue binding both ends share.  The daemon lives in ``blockfabric.target`` and
the host side in ``blockfabric.initiator`` (source folders ``target/`` and ``initiator/``);
the core imports neither.
"""

__version__ = "0.1.0"
