"""The blockfabric target daemon (installed as ``blockfabric.target``)."""
