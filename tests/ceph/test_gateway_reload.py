"""A reload (SIGHUP) of a gateway's ``gateway`` section and its namespaces' ANA groups, with
two real gateway daemons on the throwaway cluster: what can be applied is (an ANA group
moved from one gateway to another, under verified I/O, announced by ANA change events), and
what needs a restart is refused naming the key, the running configuration kept."""

from __future__ import annotations

import copy
import socket
import subprocess
import time
import uuid

import pytest

from ceph.test_gateway import NQN, _image, _remove, gateway_config, states, wait_for
from e2e.conftest import BIN, HOSTNQN, TargetProc, free_port
from initiator.host import NvmeError, connect
from service.conftest import Service
from blockfabric.protocol import StatusCode
from blockfabric.protocol import identify
from blockfabric.protocol.logpages import AnaState
from blockfabric.target.control import request

pytestmark = pytest.mark.timeout(120)
OPT, NON = AnaState.OPTIMIZED, AnaState.NON_OPTIMIZED


@pytest.fixture
def pair(ceph, tmp_path):
    images = [_image(ceph), _image(ceph)]
    group = f"l{uuid.uuid4().hex[:6]}"
    services = []
    for name, cntlids, home in (("gw-a", (1, 99), [1]), ("gw-b", (100, 199), [2])):
        conf = gateway_config(ceph, images, free_port(), name, group, cntlids, home)
        conf["control_socket"] = str(tmp_path / f"{name}.sock")
        services.append(Service(TargetProc(conf, tmp_path).start(), conf))
    yield services
    for s in services:
        s.proc.stop()
        assert "Traceback" not in s.proc.log, s.proc.log
    for img in images:
        _remove(ceph, img)


def edited(svc: Service, **gateway) -> dict:
    conf = copy.deepcopy(svc.config)
    conf["gateway"].update(gateway)
    return conf


def test_reload_moves_an_ana_group_to_another_gateway_under_io(pair):
    a_svc, b_svc = pair
    with connect("127.0.0.1", NQN, a_svc.port, provider="soft", hostnqn=HOSTNQN) as a, \
            connect("127.0.0.1", NQN, b_svc.port, provider="soft", hostnqn=HOSTNQN) as b:
        wait_for(lambda: states(a) == {1: OPT, 2: NON} and states(b) == {1: NON, 2: OPT},
                 10, "home groups owned")
        seen: dict[str, list] = {"a": [], "b": []}
        for key, ctrl in (("a", a), ("b", b)):
            ctrl.ana_listeners.append(lambda _c, log, k=key: seen[k].append(
                {g.grpid: (g.state, g.nsids) for g in log[1]}))
        # crc32c-verified I/O on namespace 1 (group 1, the one that moves) through A
        bench = subprocess.Popen(
            [str(BIN / "blockfabric"), "bench", "-a", "127.0.0.1", "-s", str(a_svc.port),
             "-n", NQN, "--provider", "soft", "--nsid", "1", "--size", "16M", "--verify",
             "crc32c", "--rw", "randrw", "--bs", "4k", "--iodepth", "8", "--runtime", "6"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        time.sleep(1.0)
        # Group 1's new home is B; A gives it up.  Either order works: here B first (it
        # asks, A still calls it home and keeps it), then A (it hands it back at once).
        b_svc.reload(edited(b_svc, ana_groups=[1, 2]))
        assert request(b_svc.config["control_socket"], "status")["last_reload_error"] is None
        assert states(a)[1] == OPT          # A is still group 1's home: nothing moved yet
        a_svc.reload(edited(a_svc, ana_groups=[]))
        took = wait_for(lambda: any(e.get(1, (None,))[0] == OPT for e in seen["b"]), 10,
                        "ANA change event on B's path: group 1 optimized")
        wait_for(lambda: any(e.get(1, (None,))[0] == NON for e in seen["a"]), 10,
                 "ANA change event on A's path: group 1 non-optimized")
        assert states(a) == {1: NON, 2: NON} and states(b) == {1: OPT, 2: OPT}
        # ... and it stays there (A does not take it back at its next renewals)
        time.sleep(2.5)
        assert states(a) == {1: NON, 2: NON} and states(b) == {1: OPT, 2: OPT}
        snap = request(a_svc.config["control_socket"], "status")["gateway"]
        assert snap["home_groups"] == [] and snap["releases"] >= 1

        # A namespace moved to another ANA group: an ANA change event, the log lists it
        # in its new group, and Identify Namespace says so.
        for svc in (a_svc, b_svc):
            conf = copy.deepcopy(svc.config)
            conf["subsystems"][0]["namespaces"][1]["ana_group"] = 1
            svc.reload(conf)
        wait_for(lambda: seen["a"] and seen["a"][-1] == {1: (NON, (1, 2))}, 10,
                 "ANA change event: namespace 2 in group 1")
        assert {g.grpid: (g.state, g.nsids) for g in b.read_ana_log()[1]} == \
            {1: (OPT, (1, 2))}
        assert identify.IdentifyNamespace.unpack_from(a._identify(0, 2)).anagrpid == 1
        out, _ = bench.communicate(timeout=60)
        assert bench.returncode == 0, out
        assert "err= 0" in out and "verified" in out, out
        # others: inaccessible, by reload: at once, with an event, and I/O on A now gets
        # the ANA status (the host would retry on another path)
        conf = copy.deepcopy(a_svc.config)
        conf["gateway"]["others"] = "inaccessible"
        a_svc.reload(conf)
        wait_for(lambda: seen["a"][-1] == {1: (AnaState.INACCESSIBLE, (1, 2))}, 10,
                 "ANA change event: group 1 inaccessible on A")
        with pytest.raises(NvmeError) as err:
            a.namespaces[1].read(0, 4096)
        assert err.value.status == StatusCode.ANA_INACCESSIBLE
    text = subprocess.run([str(BIN / "blockfabric-target"), "status", "--socket",
                           a_svc.config["control_socket"]], capture_output=True, text=True,
                          timeout=30).stdout
    assert "gateway gw-a in group" in text and "home groups none  ANA groups: 1 " \
        "inaccessible" in text, text
    for svc in pair:
        assert "reload rejected" not in svc.proc.log, svc.proc.log
    print(f"\nreload moved ANA group 1 from gw-a to gw-b: A's reload -> B's ANA change "
          f"event {took:.2f} s after A's reload")


def test_reload_refuses_what_needs_a_restart_and_keeps_running(pair):
    a_svc, b_svc = pair
    sock = a_svc.config["control_socket"]
    with connect("127.0.0.1", NQN, a_svc.port, provider="soft", hostnqn=HOSTNQN) as a, \
            socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        wait_for(lambda: states(a) == {1: OPT, 2: NON}, 10, "home group owned")
        cntlid = a.identify.cntlid
        refused = [
            (edited(a_svc, group="elsewhere"), "gateway.group: "),
            (edited(a_svc, name="gw-new"), "gateway.name: gw-a -> gw-new: cannot change"),
            ({k: v for k, v in a_svc.config.items() if k != "gateway"},
             "gateway: a reload cannot take a gateway out of its group"),
            # the connected controller's id would fall outside
            (edited(a_svc, cntlid_min=cntlid + 1, cntlid_max=cntlid + 50),
             f"gateway.cntlid_min/cntlid_max: 1-99 -> {cntlid + 1}-{cntlid + 50}: connected "
             f"controller(s) {cntlid} would be outside it"),
            # overlaps B's range in the group (checked through Ceph)
            (edited(a_svc, cntlid_max=150), "overlaps gateway gw-b's 100-199"),
            # a range registered in the group, then the reload fails after all (the metrics
            # port is taken): the registration is put back (B's reload below shows it)
            ({**edited(a_svc, cntlid_max=60),
              "metrics": {"address": "127.0.0.1", "port": busy.getsockname()[1]}},
             "Address already in use"),
        ]
        original = copy.deepcopy(a_svc.config)
        for conf, message in refused:
            a_svc.reload(conf)
            st = request(sock, "status")
            assert message in (st["last_reload_error"] or ""), (message, st["last_reload_error"])
            assert st["gateway"]["name"] == "gw-a" and st["gateway"]["group"] == \
                original["gateway"]["group"]
            assert st["gateway"]["cntlid_range"] == [1, 99]
        assert a_svc.proc.log.count("reload rejected") == len(refused)
        a_svc.config = original
        b_svc.reload(edited(b_svc, cntlid_min=61, cntlid_max=199))
        assert "overlaps gateway gw-a's 1-99" in \
            request(b_svc.config["control_socket"], "status")["last_reload_error"]
        b_svc.config = edited(b_svc)        # (Service.reload kept the refused one)
        b_svc.config["gateway"].update(cntlid_min=100, cntlid_max=199)
        # still serving, still the owner
        a.namespaces[1].write(0, b"r" * 4096)
        assert a.namespaces[1].read(0, 4096) == b"r" * 4096
        assert states(a) == {1: OPT, 2: NON}
        # a range that keeps the connected controller, disjoint from B's: applied, and
        # registered in the group (B may not take it now)
        a_svc.reload(edited(a_svc, cntlid_min=1, cntlid_max=60))
        st = request(sock, "status")
        assert st["last_reload_error"] is None and st["gateway"]["cntlid_range"] == [1, 60]
        b_svc.reload(edited(b_svc, cntlid_min=50, cntlid_max=199))
        assert "overlaps gateway gw-a's 1-60" in \
            request(b_svc.config["control_socket"], "status")["last_reload_error"]
        b_svc.reload(edited(b_svc, cntlid_min=61, cntlid_max=199))
        assert request(b_svc.config["control_socket"], "status")["last_reload_error"] is None
