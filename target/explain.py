"""``blockfabric-target check --explain HOSTNQN``: why a host can or cannot connect.

It reads only the configuration (the same rules the running target applies in
``Connector.connect`` in sessions.py and the discovery log), so it answers before anything is
started, and says what to change.
"""

from __future__ import annotations

from dataclasses import dataclass

from blockfabric.target import config as cfg


@dataclass
class Verdict:
    subnqn: str
    allowed: bool
    reason: str
    listeners: list[str]


def resolve_provider(listener: cfg.Listener) -> str:
    """What ``provider: auto`` picks here (as the target will), else the configured one."""
    if listener.provider != "auto":
        return listener.provider
    try:
        from blockfabric.rdma import get_provider
        chosen = get_provider("auto", listener.address).name
    except Exception as exc:  # an explanation must not fail on a provider probe
        return f"auto (could not probe: {exc})"
    return f"auto -> {chosen} here (verbs when an RDMA device owns {listener.address})"


def verdicts(config: cfg.TargetConfig, hostnqn: str, subnqn: str | None) -> list[Verdict]:
    out = []
    for i, sub in enumerate(config.subsystems):
        if subnqn is not None and sub.nqn != subnqn:
            continue
        if sub.allow_any_host:
            allowed, reason = True, "allow_any_host is true"
        elif hostnqn in sub.host_nqns:
            allowed, reason = True, f"listed in subsystems[{i}].hosts"
            entry = sub.host(hostnqn)
            if entry is not None and entry.dhchap_secret is not None:
                reason += ("; it must authenticate with its DH-HMAC-CHAP secret "
                           "(nvme connect --dhchap-secret)")
        else:
            allowed = False
            reason = (f"not in subsystems[{i}].hosts ({len(sub.hosts)} host(s) listed): add "
                      "it there, or set allow_any_host: true")
        listeners = [f"{x.endpoint} NVMe/TCP" if x.transport == "tcp"
                     else f"{x.endpoint} provider {resolve_provider(x)}"
                     for x in config.listeners_for(sub)]
        if not listeners:
            allowed = False
            reason += "; and no listener exposes it (check subsystems[].listeners)"
        out.append(Verdict(sub.nqn, allowed, reason, listeners))
    return out


def explain(config: cfg.TargetConfig, hostnqn: str, subnqn: str | None) -> tuple[str, bool]:
    """The explanation text, and whether the host can connect (to ``subnqn``, or to at
    least one subsystem when none is named)."""
    lines = [f"host {hostnqn}", f"configuration {config.source}"]
    found = verdicts(config, hostnqn, subnqn)
    if subnqn is not None and not found:
        known = ", ".join(s.nqn for s in config.subsystems) or "none"
        lines.append(f"  subsystem {subnqn}: NOT CONFIGURED (Connect answers invalid "
                     f"parameter 0x182; configured: {known})")
        return "\n".join(lines) + "\n", False
    for v in found:
        lines.append(f"  subsystem {v.subnqn}: {'ALLOWED' if v.allowed else 'DENIED'} "
                     f"({v.reason})")
        if not v.allowed and "hosts" in v.reason:
            lines.append("    Connect answers invalid host 0x184; discovery does not list it")
        for text in v.listeners:
            lines.append(f"    exposed on {text}")
    lines.append("  discovery: every listener serves the discovery subsystem; a host sees every "
                 "NVMe/TCP listener, and the RDMA listeners of the provider it came in on (a "
                 "kernel host on RoCE never sees a soft listener; over TCP it sees them all)")
    ok = any(v.allowed for v in found)
    if not found:
        lines.append("  no subsystems are configured")
    return "\n".join(lines) + "\n", ok
