"""The fio job files in benchmarks/fio/: the workloads promised, each accepted by fio."""

from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest

JOBS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "fio"
EXPECTED = {"seqread-1m.fio": "rw=read", "seqwrite-1m.fio": "rw=write",
            "randread-4k-qd16.fio": "iodepth=16", "randwrite-4k-qd16.fio": "iodepth=16",
            "randread-4k-qd1.fio": "ioengine=psync", "randrw-70-30-4k-qd16.fio": "rwmixread=70",
            "randread-4k-psync-16jobs.fio": "numjobs=16", "verify-crc32c.fio": "verify=crc32c",
            "randread-4k-qd4.fio": "iodepth=4", "randread-4k-qd8.fio": "iodepth=8",
            "randread-4k-qd32.fio": "iodepth=32", "randwrite-16k-qd16.fio": "bs=16k",
            "randwrite-64k-qd16.fio": "bs=64k"}


def test_every_promised_workload_has_a_job_file():
    assert {p.name for p in JOBS.glob("*.fio")} == set(EXPECTED)
    for name, line in EXPECTED.items():
        lines = (JOBS / name).read_text().splitlines()
        assert line in lines, name
        assert not any(x.startswith("filename=") for x in lines), f"{name}: the caller sets it"


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed")
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fio_accepts_the_job_file(name, tmp_path):
    done = subprocess.run(["fio", "--parse-only", f"--filename={tmp_path / 'x'}",
                           str(JOBS / name)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
