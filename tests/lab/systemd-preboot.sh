#!/bin/bash
# LAB_PREBOOT for make lab-systemd: runs in the lab guest as root before systemd is PID 1 (what
# an operator did before the reboot), from the project root, on the guest's tmpfs overlay
# (nothing reaches the host's disk).
#   - make install: the venv make lab-systemd installed at /opt/blockfabric (in a mount
#     namespace on the host: pip takes minutes under TCG) is mounted there, then
#     `make install-units` puts the links, units and default configuration in place
#   - a mount at boot: /etc/blockfabric/initiator.yaml names it, blockfabric-mount@vol0 is
#     enabled; the target is installed but not enabled (it is down at boot)
set -euo pipefail
mkdir -p /opt/blockfabric
mount --bind -o ro build/lab-systemd-opt /opt/blockfabric
make --no-print-directory install-units
mkdir -p /mnt/vol0
cat > /etc/blockfabric/initiator.yaml <<'YAML'
mounts:
  - name: vol0
    traddr: 127.0.0.1
    nqn: nqn.2026-12.io.blockfabric:lab-ram
    mountpoint: /mnt/vol0
    provider: soft
    options: [direct_io]
    nr_io_queues: 1
    reconnect_delay: 1
    ctrl_loss_tmo: 600
YAML
systemctl enable blockfabric-mount@vol0.service
