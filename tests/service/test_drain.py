"""SIGTERM during a write-heavy load on a file volume: every write the host saw
acknowledged is in the file after the daemon exits, and the exit code is 0."""

from __future__ import annotations

import os
import random
import signal
import threading
import time

from .conftest import base_config, free_port

BS = 4096
# 1 GiB, sparse: enough blocks that the writers never run out before the target stops, however
# fast the data path gets (64 MiB ran out once the host acknowledged 4000+ writes in the window).
NBLOCKS = 262144


def test_sigterm_drains_and_loses_no_acknowledged_write(tmp_path, start_service):
    volume = tmp_path / "vol.img"
    config = base_config(tmp_path, free_port())
    config["subsystems"][0]["namespaces"] = [
        {"nsid": 1, "backend": "file", "path": str(volume), "size": NBLOCKS * BS}]
    svc = start_service(config)
    # The host holds I/O across a lost target for ctrl_loss_tmo (nvme-cli semantics); keep it
    # short so the writers see the failure soon after the daemon is gone.
    ctrl = svc.connect(nr_io_queues=2, queue_size=64, ctrl_loss_tmo=2, reconnect_delay=0.5)
    ns = ctrl.namespaces[1]
    acked: dict[int, bytes] = {}          # first block -> data, for acknowledged writes only
    lock = threading.Lock()
    next_block = iter(range(0, NBLOCKS - 4, 4))   # every write to blocks of its own
    stop = threading.Event()
    errors: list[BaseException] = []

    def writer(seed: int) -> None:
        rng = random.Random(seed)
        pending = []
        try:
            while not stop.is_set():
                with lock:
                    block = next(next_block, None)
                if block is None:
                    errors.append(AssertionError("the writers ran out of blocks"))
                    break
                data = rng.randbytes(BS * rng.randint(1, 4))
                pending.append((block, data, ns.submit_write(block * BS, data)))
                if len(pending) >= 16:
                    block, data, fut = pending.pop(0)
                    fut.result(15)
                    with lock:
                        acked[block] = data
        except BaseException as exc:     # the queue dies when the target stops
            errors.append(exc)
        for block, data, fut in pending:
            try:
                fut.result(15)
            except BaseException:
                continue
            with lock:
                acked[block] = data

    threads = [threading.Thread(target=writer, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    with lock:
        before = len(acked)
    assert before > 20, "the load did not get going"
    svc.proc.proc.send_signal(signal.SIGTERM)
    code = svc.proc.proc.wait(25)
    # The writers go on until the host fails what it held for ctrl_loss_tmo: each then sees
    # the error. Stopping them at the daemon's exit instead would race that (a writer whose
    # oldest write was acknowledged before the drain would quit without noticing).
    for t in threads:
        t.join(20)
    stop.set()
    ctrl.close()
    assert code == 0, svc.proc.log
    assert "drained: volumes flushed" in svc.proc.log, svc.proc.log
    assert volume.stat().st_size == NBLOCKS * BS
    with open(volume, "rb") as f:
        missing = [b for b, data in acked.items()
                   if os.pread(f.fileno(), len(data), b * BS) != data]
    assert not missing, f"{len(missing)} of {len(acked)} acknowledged writes are not on disk"
    assert errors, "the host never noticed the target going away"
    assert not [e for e in errors if "ran out of blocks" in str(e)], errors


def test_drain_fdatasyncs_after_the_last_write(tmp_path):
    """The flush is real: under strace, an fdatasync follows the volume's last pwritev."""
    import shutil
    import subprocess
    import sys

    import pytest
    import yaml

    if shutil.which("strace") is None:
        pytest.skip("strace is missing (Debian package strace)")
    from blockfabric.initiator.host import connect

    from .conftest import NQN, HOSTNQN
    volume = tmp_path / "vol.img"
    port = free_port()
    config = base_config(tmp_path, port)
    config["subsystems"][0]["namespaces"] = [
        {"nsid": 1, "backend": "file", "path": str(volume), "size": "4MiB"}]
    conf = tmp_path / "t.yaml"
    conf.write_text(yaml.safe_dump(config))
    trace = tmp_path / "trace"
    proc = subprocess.Popen(["strace", "-f", "-qq", "-e", "trace=pwritev,pwritev2,fdatasync",
                             "-o", str(trace), sys.executable, "-m", "blockfabric.target.cli",
                             "run", "-C", str(conf)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                ctrl = connect("127.0.0.1", NQN, port, provider="soft", hostnqn=HOSTNQN,
                               nr_io_queues=1)
                break
            except ConnectionError:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.1)
        with ctrl:
            for i in range(8):
                ctrl.namespaces[1].write(i * 8192, random.Random(i).randbytes(8192))
            # SIGTERM to the daemon itself (strace does not pass signals on); its pid
            # comes from the control socket.
            from blockfabric.target.control import request
            pid = request(config["control_socket"], "status")["pid"]
            assert pid != proc.pid
            os.kill(pid, signal.SIGTERM)
            assert proc.wait(30) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = trace.read_text().splitlines()
    writes = [i for i, line in enumerate(lines) if "pwritev" in line and "= 8192" in line]
    syncs = [i for i, line in enumerate(lines) if "fdatasync(" in line and "= 0" in line]
    assert len(writes) >= 8, lines[-20:]
    assert syncs and syncs[-1] > writes[-1], lines[-20:]
