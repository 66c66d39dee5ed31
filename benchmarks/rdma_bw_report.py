"""rdma_bw's report: the machine it ran on, the Markdown tables, and issue 14's Goal section
(the two ratios of its acceptance, each PASS or FAIL).
"""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path
from typing import Any

KiB, MiB = 1 << 10, 1 << 20


def human(size: int) -> str:
    for unit, scale in (("MiB", MiB), ("KiB", KiB)):
        if size >= scale and size % scale == 0:
            return f"{size // scale} {unit}"
    return f"{size} B"


def machine() -> dict:
    return {"nproc": os.cpu_count(), "loadavg": list(os.getloadavg()),
            "kernel": platform.release(), "python": platform.python_version(),
            "cpu": _cpu_model()}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


#: Issue 14's acceptance for the soft provider: (size, goal, what the ratio is against).
ACCEPT_4K_VS_TCP_RR = 1.0     # 4 KiB message rate / a Python TCP request-response loop
ACCEPT_1M_VS_TCP_STREAM = 0.9  # 1 MiB bandwidth / a Python socket stream


def acceptance(results: dict) -> list[str]:
    """The two ratios of issue 14's acceptance, each PASS or FAIL (or why it is missing):
    the 4 KiB RDMA WRITE and READ message rates (``-t`` in flight) against a plain Python TCP
    request/response loop of 4 KiB (``tcp_lat``: exchanges per second, one at a time), and
    1 MiB WRITE and READ bandwidth against a Python socket stream (``tcp``)."""
    out = ["", "## Goal", "", "Issue 14's acceptance (both WRITE and READ must reach the goal):",
           ""]
    small, big = results.get(4 * KiB, {}), results.get(MiB, {})
    rates = {n: small[n]["median"]["msg_s"] for n in ("write", "read") if n in small}
    rr = small.get("tcp_lat", {}).get("median", {}).get("msg_s")
    if rates and rr:
        got = {n: r / rr for n, r in rates.items()}
        out.append(f"- 4 KiB message rate >= {ACCEPT_4K_VS_TCP_RR:g}x a Python TCP "
                   f"request/response loop of 4 KiB ({rr:.0f} exchanges/s): "
                   + ", ".join(f"{n.upper()} {rates[n]:.0f} msg/s = {g:.2f}x"
                               for n, g in got.items())
                   + f" -> **{_pass(min(got.values()) >= ACCEPT_4K_VS_TCP_RR)}**")
    else:
        out.append("- 4 KiB message rate vs a Python TCP request/response loop: not measured "
                   "(needs --sizes with 4K and --tests with write or read, and tcp_lat)")
    got = {n: big[f"{n}_vs_tcp"] for n in ("write", "read") if f"{n}_vs_tcp" in big}
    if got:
        out.append(f"- 1 MiB bandwidth >= {ACCEPT_1M_VS_TCP_STREAM:g}x a Python socket stream "
                   f"({big['tcp']['median']['MiB_s']:.0f} MiB/s): "
                   + ", ".join(f"{n.upper()} {g:.2f}x" for n, g in got.items())
                   + f" -> **{_pass(min(got.values()) >= ACCEPT_1M_VS_TCP_STREAM)}**")
    else:
        out.append("- 1 MiB bandwidth vs a Python socket stream: not measured (needs --sizes "
                   "with 1M and --tests with write or read, and tcp)")
    small_lat = small.get("send_lat", {}).get("median")
    if small_lat:
        out += ["", f"4 KiB SEND latency p50 {small_lat['p50_us']:.1f} us, p99 "
                f"{small_lat['p99_us']:.1f} us (RTT/2)"]
    return out


def _pass(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def render_md(cfg: Any, results: dict, command: str, before: dict, after: dict) -> str:
    out = [f"# rdma_bw: {cfg.provider} provider"
           + (f" ({cfg.progress} progress)" if cfg.provider == "soft" else ""),
           "",
           f"- command: `{command}`",
           f"- date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
           f"- machine: {before['cpu']}, nproc {before['nproc']}, kernel {before['kernel']}, "
           f"Python {before['python']}",
           f"- load average before: {' '.join(f'{x:.2f}' for x in before['loadavg'])}; "
           f"after: {' '.join(f'{x:.2f}' for x in after['loadavg'])}",
           f"- address {cfg.address}, {cfg.depth} messages in flight (-t), median of "
           f"{cfg.runs} run(s), completion wait: {cfg.wait}",
           "- MiB/s = 2^20 bytes/s; Gb/s = 10^9 bit/s; latency = RTT/2 of a SEND ping-pong",
           "  (ib_send_lat's convention); `tcp` = plain TCP stream between the same two",
           "  processes (`sendall(memoryview)` -> `recv_into`), the soft provider's ceiling",
           "", "## Bandwidth", "",
           "| size | iters | WRITE MiB/s | WRITE Gb/s | WRITE msg/s | READ MiB/s | READ Gb/s "
           "| READ msg/s | TCP MiB/s | TCP Gb/s | WRITE/TCP | READ/TCP |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def cell(row: dict, name: str, key: str, fmt: str = "{:.0f}") -> str:
        return fmt.format(row[name]["median"][key]) if name in row else "-"

    for size, row in results.items():
        iters = next((row[n]["median"]["iters"] for n in ("write", "read", "tcp") if n in row),
                     "-")
        out.append(" | ".join([
            f"| {human(size)}", f"{iters:.0f}" if iters != "-" else iters,
            cell(row, "write", "MiB_s"), cell(row, "write", "Gb_s", "{:.2f}"),
            cell(row, "write", "msg_s"), cell(row, "read", "MiB_s"),
            cell(row, "read", "Gb_s", "{:.2f}"), cell(row, "read", "msg_s"),
            cell(row, "tcp", "MiB_s"), cell(row, "tcp", "Gb_s", "{:.2f}"),
            f"{row['write_vs_tcp']:.2f}x" if "write_vs_tcp" in row else "-",
            f"{row['read_vs_tcp']:.2f}x" if "read_vs_tcp" in row else "-"]) + " |")
    out += ["", "## Latency (SEND ping-pong, RTT/2)", "",
            "| size | iters | send p50 us | send p99 us | TCP p50 us | TCP p99 us |",
            "|---:|---:|---:|---:|---:|---:|"]
    for size, row in results.items():
        if "send_lat" not in row and "tcp_lat" not in row:
            continue
        iters = next(row[n]["median"]["iters"] for n in ("send_lat", "tcp_lat") if n in row)
        out.append(" | ".join([
            f"| {human(size)}", f"{iters:.0f}",
            cell(row, "send_lat", "p50_us", "{:.1f}"), cell(row, "send_lat", "p99_us", "{:.1f}"),
            cell(row, "tcp_lat", "p50_us", "{:.1f}"), cell(row, "tcp_lat", "p99_us", "{:.1f}")])
            + " |")
    out += acceptance(results)
    return "\n".join(out) + "\n"
