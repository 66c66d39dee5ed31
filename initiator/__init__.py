"""The blockfabric host side: library, FUSE mount and CLI (installed as
``blockfabric.initiator``)."""
