"""The two ends of an NVMe-oF queue over RDMA and over NVMe/TCP, their registered buffers,
and the reactor that drives them."""
