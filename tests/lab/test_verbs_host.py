"""Host-side tests of the verbs provider: what must hold without an RDMA device.

The real-device checks run in the lab (tests/lab/run-suite.sh through lab/run); these pin the
pieces that decide whether the provider is usable at all and how it finds what pyverbs hides.
"""

from __future__ import annotations

import ctypes
import os
import socket
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from blockfabric.errors import ProviderUnavailable, RdmaError
from blockfabric.rdma.verbs import _native

ROOT = Path(__file__).resolve().parents[2]
HAS_DEVICE = Path("/dev/infiniband/rdma_cm").exists() and any(
    Path("/sys/class/infiniband").glob("*")) if Path("/sys/class/infiniband").exists() else False


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)


def test_importing_the_rdma_layer_loads_no_pyverbs():
    out = _run("import sys, blockfabric.rdma, blockfabric.rdma.verbs as v\n"
               "assert v.VerbsProvider\n"
               "print(sorted(m for m in sys.modules if m.startswith('pyverbs')))")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.skipif(HAS_DEVICE, reason="this host has an RDMA device")
def test_no_device_is_provider_unavailable_with_the_fix():
    from blockfabric.rdma.verbs import VerbsProvider
    with pytest.raises(ProviderUnavailable) as info:
        VerbsProvider()
    text = str(info.value)
    assert "\n" not in text
    assert "rdma link add" in text or "pyverbs not importable" in text
    assert "--provider soft" in text


def test_missing_pyverbs_is_provider_unavailable():
    # a path entry that shadows pyverbs with an unimportable package
    code = ("import sys, types\n"
            "sys.modules['pyverbs'] = None\n"
            "from blockfabric.rdma.verbs import VerbsProvider\n"
            "from blockfabric.errors import ProviderUnavailable\n"
            "try:\n    VerbsProvider()\nexcept ProviderUnavailable as e:\n    print(e)\n")
    out = _run(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("pyverbs not importable: apt-get install python3-pyverbs")


def test_auto_falls_back_to_soft_without_a_device(monkeypatch):
    import blockfabric.rdma as rdma
    if HAS_DEVICE:
        pytest.skip("this host has an RDMA device")
    monkeypatch.setattr(rdma, "_instances", {})
    chosen = []
    monkeypatch.setattr(rdma, "get_provider", _recording(rdma.get_provider, chosen))
    try:
        rdma.get_provider("auto", "10.99.0.1")
    except ProviderUnavailable:
        pass                     # the soft provider may not exist yet; the choice is what counts
    except ImportError:
        pass
    assert "verbs" in chosen and chosen[-1] == "soft"


def _recording(real, chosen):
    def wrapper(name="auto", address=None):
        chosen.append(name)
        return real(name, address)
    return wrapper


def test_create_with_fd_finds_the_one_new_descriptor_and_makes_it_nonblocking(tmp_path):
    target = tmp_path / "dev"
    target.write_bytes(b"x")
    decoy = os.open(os.devnull, os.O_RDONLY)     # open before: must not be picked
    try:
        fobj, fd = _native.create_with_fd(lambda: open(target, "rb"), str(target))
        try:
            assert fd == fobj.fileno()
            assert os.get_blocking(fd) is False
        finally:
            fobj.close()
    finally:
        os.close(decoy)


def test_create_with_fd_refuses_to_guess(tmp_path):
    target = tmp_path / "dev"
    target.write_bytes(b"x")
    opened = []

    def two():
        opened.extend([open(target, "rb"), open(target, "rb")])
        return opened[0]
    with pytest.raises(RdmaError, match="2 new descriptors"):
        _native.create_with_fd(two, str(target))
    for f in opened:
        f.close()


class _Holder:
    """A Python object whose instance words include a C pointer, like a pyverbs object."""

    __slots__ = ("a", "ptr", "b")


def test_c_pointer_is_found_only_when_it_validates():
    fd_struct = ctypes.c_int(1234)               # stands in for struct rdma_event_channel
    holder = _Holder()
    holder.a, holder.b = "x", "y"
    offset = _slot_offset(holder, "ptr")
    saved = ctypes.c_void_p.from_address(id(holder) + offset).value
    ctypes.c_void_p.from_address(id(holder) + offset).value = ctypes.addressof(fd_struct)
    try:
        assert _native.channel_pointer(holder, 1234) == ctypes.addressof(fd_struct)
        _native._offsets.clear()
        with pytest.raises(RdmaError, match="unsupported pyverbs build"):
            _native.channel_pointer(holder, 4321)
    finally:
        ctypes.c_void_p.from_address(id(holder) + offset).value = saved
        _native._offsets.clear()


def _slot_offset(obj, name: str) -> int:
    """Where the slot's PyObject* lives (slots follow the header, as Cython fields do)."""
    marker = object()
    setattr(obj, name, marker)
    for off in range(16, type(obj).__basicsize__, 8):
        if ctypes.c_void_p.from_address(id(obj) + off).value == id(marker):
            setattr(obj, name, None)
            return off
    raise AssertionError("slot not found")


def test_sockaddr_decoding_of_a_cm_id():
    # struct rdma_cm_id: 4 pointers, then route.addr: src then dst sockaddr_storage (128 B)
    raw = bytearray(32 + 256)
    struct.pack_into("=H", raw, 32, socket.AF_INET)
    struct.pack_into("!H4s", raw, 34, 4420, socket.inet_aton("10.99.0.1"))
    struct.pack_into("=H", raw, 160, socket.AF_INET6)
    struct.pack_into("!H4x16s", raw, 162, 51000, socket.inet_pton(socket.AF_INET6, "fe80::1"))
    buf = (ctypes.c_char * len(raw)).from_buffer(raw)
    local, peer = _native.id_addresses(ctypes.addressof(buf))
    assert local == ("10.99.0.1", 4420)
    assert peer == ("fe80::1", 51000)


def test_lab_scripts_parse():
    for script in ("lab/setup", "lab/run", "lab/guest-init", "tests/lab/run-suite.sh"):
        out = subprocess.run(["bash", "-n", str(ROOT / script)], capture_output=True, text=True)
        assert out.returncode == 0, f"{script}: {out.stderr}"
