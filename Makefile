# blockfabric: the two commands a newcomer needs are `make demo` and `make test`.
# Both are idempotent and do all the set-up on a fresh Debian 12 machine as root:
# Debian packages that are missing, then a venv made from Debian's python3 with
# --system-site-packages (so Debian's python3-pyverbs is importable), then the project.

SHELL       := /bin/bash
PYTHON_SYS  := /usr/bin/python3
VENV        := .venv
PY          := $(VENV)/bin/python
STAMP       := $(VENV)/.installed
PYTEST_ARGS ?=

# Debian packages, and why:
#   python3-venv       the venv itself (ensurepip)
#   fuse3 libfuse3-3   FUSE mounts of remote namespaces
#   fio                benchmarks and verify workloads through the mount
#   python3-pyverbs rdma-core ibverbs-providers   the verbs RDMA provider
#   iproute2           ip netns/veth, used by the multi-host tests
#   util-linux e2fsprogs   losetup, mkfs.ext4, fsck for the block-device tests
#   strace             tests that prove fsync/rename ordering with the real syscalls
#   systemd            systemd-analyze verify on the unit files (PID 1 need not be systemd)
#   qemu-utils         qemu-img, one of the block-image tools the mounted files must satisfy
#   nbdkit nbdkit-plugin-python libnbd-bin python3-libnbd python3-matplotlib
#                      the peers blockfabric is measured against (make bench, and its --quick
#                      smoke test in make test), and the chart
#   nftables           packet loss on a veth for the fault tests
#   ceph-mon ceph-osd ceph-common python3-rbd python3-rados
#                      backend rbd (python3-rbd, python3-rados) and the throwaway one-node
#                      cluster its tests bring up (tests/ceph/ceph-up.sh; no ceph-mgr needed)
DEB_PKGS := python3-venv fuse3 libfuse3-3 fio python3-pyverbs rdma-core \
            ibverbs-providers iproute2 util-linux e2fsprogs strace systemd qemu-utils \
            nbdkit nbdkit-plugin-python libnbd-bin python3-libnbd python3-matplotlib nftables \
            ceph-mon ceph-osd ceph-common python3-rbd python3-rados

.PHONY: all deps venv lint typecheck test test-reactors demo lab lab-auth lab-resv lab-suites lab-systemd install install-venv install-units \
        uninstall bench bench-cost bench-rdma bench-rdma-lab bench-verbs-lab soak fuzz clean help

all: help

help:
	@echo "make demo   set up, start a ramdisk target on the soft provider, mount it, benchmark, clean up"
	@echo "make test   set up and run the full test suite (make lint first)"
	@echo "make test-reactors   the e2e, fault and hostile suites again, every target with 2 poll groups"
	@echo "make lint   pyflakes and pycodestyle (format) checks through ruff, and make typecheck (rules in pyproject.toml)"
	@echo "make typecheck   mypy: strict on blockfabric/protocol and blockfabric/fabric, default elsewhere"
	@echo "make lab    the RDMA contract suite on verbs: Soft-RoCE in a QEMU guest (root)"
	@echo "make lab-auth   DH-HMAC-CHAP interop with the kernel (a guest with Debian's 6.12 kernel)"
	@echo "make lab-resv   reservations seen by the kernel's host: nvme resv-* of three host NQNs (6.12 guest)"
	@echo "make lab-systemd   the units under a real systemd (PID 1 in a lab guest), verbs on rxe0"
	@echo "make lab-suites   the e2e, fault and hostile suites on verbs (rxe0), 1 and 2 reactors (slow)"
	@echo "make install   (root) /opt/blockfabric, /usr/local/bin links, units, a default config"
	@echo "make uninstall (root) the reverse; /etc/blockfabric and /var/lib/blockfabric stay"
	@echo "make bench  fio side by side with nbdkit+nbdfuse, the Python floor and tmpfs -> benchmarks/results/"
	@echo "make bench-cost   CPU us per I/O, poll mount vs the Python floor, ~1 min (COST_ARGS=...)"
	@echo "make bench-rdma   soft RDMA against its TCP ceiling -> benchmarks/results/"
	@echo "make bench-verbs-lab   4 KiB IOPS, p50/p99, CPU/IO of target + bench on verbs over rxe (lab, root)"
	@echo "make soak   long verify run with faults injected (SOAK_DURATION=600)"
	@echo "make fuzz   the soft-wire and capsule fuzzers with fresh seeds (FUZZ_SECONDS=300 each)"
	@echo "make clean  remove the venv and build leftovers"

deps:
	@missing=""; \
	for p in $(DEB_PKGS); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "install ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  if [ "$$(id -u)" != 0 ]; then echo "run as root to install:$$missing" >&2; exit 1; fi; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get update -q && apt-get install -y -q --no-install-recommends $$missing; \
	fi

$(STAMP): pyproject.toml | deps
	@test -x $(PY) || $(PYTHON_SYS) -m venv --system-site-packages $(VENV)
	$(PY) -m pip install -q --upgrade pip "setuptools>=77" wheel
	$(PY) -m pip install -q -e '.[test]'
	@touch $@

venv: deps $(STAMP)

# The end-to-end and FUSE suites run a second time with the soft provider's engine on its
# own thread (thread progress) instead of driven by the reactors (poll, the default): both
# modes are supported.
# test: the whole suite, then the end-to-end and FUSE suites again with the soft provider's
# thread progress.  Test files run on TEST_JOBS pytest-xdist workers (--dist loadfile: a file's
# tests and its module fixtures stay on one worker); most tests wait on daemons, sockets and
# timeouts rather than compute, so 3 workers on 2 cores took 312 s where one took 450-480 s.
# TEST_JOBS=0 runs in one process, as plain pytest does.
TEST_JOBS ?= 3
# lint: ruff's pyflakes checks (unused and undefined names and imports, syntax) and its
# pycodestyle format check (whitespace, indentation, blank lines, line length; the rules and why
# not `ruff format` are in pyproject.toml), a second or so; make test runs it first.
lint: venv typecheck
	$(PY) -m ruff check .

# mypy sees the package as it is installed: blockfabric/ with target/ and initiator/ inside it
# (as blockfabric.target and blockfabric.initiator), through a tree of links in the venv.
# Paths in its messages are turned back into the repository's.
TYPECHECK_TREE := $(VENV)/typecheck
typecheck: venv
	@rm -rf $(TYPECHECK_TREE)/blockfabric && mkdir -p $(TYPECHECK_TREE)/blockfabric
	@for f in blockfabric/*.py blockfabric/*/; do ln -s "$$PWD/$${f%/}" $(TYPECHECK_TREE)/blockfabric/; done
	@ln -s "$$PWD/target" "$$PWD/initiator" $(TYPECHECK_TREE)/blockfabric/
	set -o pipefail; cd $(TYPECHECK_TREE) && $(CURDIR)/$(PY) -m mypy \
	  --config-file $(CURDIR)/pyproject.toml -p blockfabric \
	  | sed -e 's,^blockfabric/target/,target/,' -e 's,^blockfabric/initiator/,initiator/,'
XDIST = $(if $(filter 0,$(TEST_JOBS)),,-n $(TEST_JOBS) --dist loadfile)
test: lint
	$(PY) -m pytest $(XDIST) $(PYTEST_ARGS)
	BLOCKFABRIC_SOFT_PROGRESS=thread $(PY) -m pytest $(XDIST) tests/e2e tests/fuse $(PYTEST_ARGS)

# test-reactors: the end-to-end, fault and hostile suites once more with every target they
# start at `reactors: 2` (BLOCKFABRIC_TEST_REACTORS; the I/O queues in a worker process), but
# for the tests already parametrised with 1 and 2 reactors, which make test runs both ways.
# About 2.5 minutes; .ci/run runs it after make test.
test-reactors: venv
	BLOCKFABRIC_TEST_REACTORS=2 $(PY) -m pytest $(XDIST) tests/e2e tests/faults tests/hostile \
	  -k "not 1r and not 2r" $(PYTEST_ARGS)

demo: venv
	$(PY) scripts/demo.py

# The lab boots Debian's stock kernel under QEMU with rdma_rxe (Soft-RoCE) and runs, in one
# boot, the RDMA contract suite on rxe0 with the verbs provider and the interop suite
# against the Linux kernel's own NVMe-oF host and target (tests/lab/all.sh). lab/setup installs what it needs and exits 77 where
# QEMU or the kernel package cannot be had: only then is the lab skipped.
LAB_TIMEOUT ?= 2400
lab: venv
	@rc=0; lab/setup || rc=$$?; \
	if [ $$rc = 77 ]; then echo "make lab: SKIP: QEMU or the kernel cannot be installed here"; exit 0; fi; \
	[ $$rc = 0 ] || exit $$rc; \
	set -o pipefail; \
	{ echo "# lab/run tests/lab/all.sh  ($$(date -u +%F), Debian $$(cat $${LAB_HOME:-/var/lib/rdma-lab}/kver) guest under QEMU, rxe0 on labnet0)"; \
	  LAB_TIMEOUT=$(LAB_TIMEOUT) lab/run tests/lab/all.sh 2>&1; } | tee tests/lab/last-run.txt; rc=$$?; \
	sed -n '/^##### interop:/,$$p' tests/lab/last-run.txt > tests/lab/last-interop.txt; exit $$rc

# install: the programs in a venv of their own under PREFIX (Debian's python3 with
# --system-site-packages, so Debian's python3-pyverbs is importable, as in .venv), their console
# scripts linked into BINDIR (where the units' ExecStart= points: the units are rewritten when
# BINDIR is not /usr/local/bin), the units into UNITDIR, operations.md into DOCDIR (the units'
# Documentation=), and $(CONFDIR)/target.yaml only if there is none.  Nothing is enabled or
# started.  Run again to upgrade (the project is reinstalled even at the same version).
# INSTALL_FROM: what pip installs (this checkout, or a wheel); PIP_INSTALL_ARGS e.g.
# "--no-index --find-links DIR" on a machine without an index (the lab guest).
# docs/operations.md (Install) lists the same steps for a package maintainer.
PREFIX           ?= /opt/blockfabric
BINDIR           ?= /usr/local/bin
UNITDIR          ?= /etc/systemd/system
CONFDIR          ?= /etc/blockfabric
DOCDIR           ?= /usr/local/share/doc/blockfabric
INSTALL_FROM     ?= .
PIP_INSTALL_ARGS ?=
PROGRAMS         := blockfabric-target blockfabric
UNITS            := blockfabric-target.service blockfabric-mount@.service
install: install-venv install-units

# the programs: the venv (a package build, e.g. with dh-virtualenv, makes the same at PREFIX)
install-venv:
	@[ "$$(id -u)" = 0 ] || { echo "make install: run as root" >&2; exit 1; }
	test -x $(PREFIX)/bin/python || $(PYTHON_SYS) -m venv --system-site-packages $(PREFIX)
	$(PREFIX)/bin/python -m pip install -q --no-warn-script-location $(PIP_INSTALL_ARGS) \
	    '$(INSTALL_FROM)'
	cd / && $(PREFIX)/bin/blockfabric-target --help > /dev/null

# everything else: plain files (links, units, docs, a default configuration)
install-units:
	@[ "$$(id -u)" = 0 ] || { echo "make install: run as root" >&2; exit 1; }
	test -x $(PREFIX)/bin/blockfabric-target
	install -d $(BINDIR) $(UNITDIR) $(DOCDIR) $(CONFDIR)
	for p in $(PROGRAMS); do ln -sfn $(PREFIX)/bin/$$p $(BINDIR)/$$p; done
	for u in $(UNITS); do \
	  sed -e 's|/usr/local/bin/|$(BINDIR)/|g' -e 's|/usr/share/doc/blockfabric|$(DOCDIR)|g' \
	      -e 's|/etc/blockfabric|$(CONFDIR)|g' \
	      systemd/$$u > $(UNITDIR)/$$u.tmp && chmod 0644 $(UNITDIR)/$$u.tmp && \
	  mv $(UNITDIR)/$$u.tmp $(UNITDIR)/$$u; done
	install -m 0644 docs/operations.md $(DOCDIR)/operations.md
	install -m 0644 docs/ceph.md $(DOCDIR)/ceph.md
	install -m 0644 configs/initiator.yaml $(DOCDIR)/initiator.yaml.example
	@if [ -e $(CONFDIR)/target.yaml ]; then echo "kept $(CONFDIR)/target.yaml"; \
	 else install -m 0644 configs/target.yaml $(CONFDIR)/target.yaml && \
	      echo "installed $(CONFDIR)/target.yaml (a 1 GiB ramdisk on 127.0.0.1: edit it)"; fi
	@if [ -d /run/systemd/system ]; then systemctl daemon-reload; fi
	@echo "installed in $(PREFIX); next: systemctl enable --now blockfabric-target"

# uninstall: stop and disable the units, remove them, the links (only those into PREFIX), the
# docs and PREFIX.  The configuration ($(CONFDIR)) and the volumes (/var/lib/blockfabric) stay.
uninstall:
	@[ "$$(id -u)" = 0 ] || { echo "make uninstall: run as root" >&2; exit 1; }
	@if [ -d /run/systemd/system ]; then \
	  systemctl disable --now blockfabric-target.service 2> /dev/null || true; \
	  for u in $$(systemctl list-units --all --plain --no-legend 'blockfabric-mount@*' | \
	              awk '{print $$1}'); do systemctl stop "$$u"; done; fi
	for u in $(UNITS); do rm -f $(UNITDIR)/$$u; done
	find $(UNITDIR) -path '*.wants/blockfabric-*' -type l -delete
	for p in $(PROGRAMS); do \
	  case "$$(readlink $(BINDIR)/$$p)" in $(PREFIX)/*) rm -f $(BINDIR)/$$p ;; esac; done
	rm -rf $(DOCDIR) $(PREFIX)
	@if [ -d /run/systemd/system ]; then systemctl daemon-reload; fi
	@echo "uninstalled; $(CONFDIR) and /var/lib/blockfabric are left in place"

# lab-systemd: the installed units under a real systemd.  The lab guest boots systemd as PID 1
# (LAB_INIT=systemd, the same kernel and artefacts as make lab).  `make install-venv` runs
# here, offline from wheels built here, in a mount namespace of its own with a tmpfs on /opt
# (so /opt/blockfabric is its real path, and this machine's /opt is untouched): pip under
# TCG takes minutes.  The guest mounts that venv on its /opt/blockfabric, runs
# `make install-units` and enables a mount before systemd starts; then
# tests/lab/systemd.sh starts, reloads, hangs, kills and stops the target service with hosts
# doing verified I/O, the kernel's nvme-rdma host among them (rxe0).  Skips exactly where
# make lab does; output in tests/lab/last-systemd-run.txt.
LAB_SYSTEMD_TIMEOUT ?= 900
lab-systemd: venv
	@rc=0; lab/setup || rc=$$?; \
	if [ $$rc = 77 ]; then echo "make lab-systemd: SKIP: QEMU or the kernel cannot be installed here"; exit 0; fi; \
	[ $$rc = 0 ] || exit $$rc; \
	rm -rf build/lab-systemd-wheels build/lab-systemd-opt; \
	$(PY) -m pip wheel -q -w build/lab-systemd-wheels . 2>&1 | grep -v "is ignored" >&2; \
	ls build/lab-systemd-wheels/blockfabric-*.whl > /dev/null || exit 1; \
	unshare -m --propagation private sh -ec 'mount -t tmpfs tmpfs /opt; \
	  make --no-print-directory install-venv INSTALL_FROM=blockfabric \
	    PIP_INSTALL_ARGS="--no-index --find-links build/lab-systemd-wheels"; \
	  cp -a /opt/blockfabric build/lab-systemd-opt' || exit 1; \
	set -o pipefail; t0=$$(date +%s); \
	{ echo "# lab/run tests/lab/systemd.sh  ($$(date -u +%F), Debian $$(cat $${LAB_HOME:-/var/lib/rdma-lab}/kver) guest, systemd as PID 1, rxe0 on labnet0)"; \
	  LAB_INIT=systemd LAB_PREBOOT=tests/lab/systemd-preboot.sh \
	  LAB_TIMEOUT=$(LAB_SYSTEMD_TIMEOUT) lab/run tests/lab/systemd.sh 2>&1; } \
	  | tee tests/lab/last-systemd-run.txt; rc=$$?; \
	echo "make lab-systemd: rc=$$rc in $$(( $$(date +%s) - t0 )) s" | tee -a tests/lab/last-systemd-run.txt; \
	exit $$rc

# Benchmarks are never part of `make test`: they take minutes and want a quiet machine.
# lab-auth: DH-HMAC-CHAP against the kernel's own NVMe host and target, in a guest with
# Debian's 6.12 kernel (6.1, the lab's default, has no NVMe in-band authentication, so
# make lab prints SKIP for these cases).  Skips, saying so, where that kernel cannot be had.
LAB_AUTH_HOME ?= /var/lib/rdma-lab-612
LAB_AUTH_KPKG ?= linux-image-6.12-amd64
lab-auth: venv
	@rc=0; LAB_HOME=$(LAB_AUTH_HOME) LAB_KPKG=$(LAB_AUTH_KPKG) lab/setup || rc=$$?; \
	if [ $$rc = 77 ]; then echo "make lab-auth: SKIP: $(LAB_AUTH_KPKG) or QEMU cannot be installed here"; exit 0; fi; \
	[ $$rc = 0 ] || exit $$rc; \
	set -o pipefail; \
	{ echo "# LAB_HOME=$(LAB_AUTH_HOME) lab/run tests/lab/interop.sh  ($$(date -u +%F), Debian $$(cat $(LAB_AUTH_HOME)/kver) guest under QEMU, rxe0 on labnet0)"; \
	  LAB_HOME=$(LAB_AUTH_HOME) LAB_TIMEOUT=$(LAB_TIMEOUT) lab/run tests/lab/interop.sh 2>&1; } | tee tests/lab/last-interop-auth.txt

# lab-resv: persistent reservations (issue 17) as the Linux kernel's NVMe host sees them, in
# the 6.12 guest of lab-auth: three host NQNs connect to blockfabric-target (verbs on rxe0) and
# nvme-cli's resv-register/acquire/report/release/notif-log on each one's /dev/nvmeXnY, with
# O_DIRECT reads and writes, check the six types, conflicts, preempt and abort, PTPL across a
# target SIGKILL and clear (tests/lab/resv.sh).  About 4 minutes under TCG; output in
# tests/lab/last-resv-run.txt.  Skips where lab-auth does.
LAB_RESV_TIMEOUT ?= 1200
lab-resv: venv
	@rc=0; LAB_HOME=$(LAB_AUTH_HOME) LAB_KPKG=$(LAB_AUTH_KPKG) lab/setup || rc=$$?; \
	if [ $$rc = 77 ]; then echo "make lab-resv: SKIP: $(LAB_AUTH_KPKG) or QEMU cannot be installed here"; exit 0; fi; \
	[ $$rc = 0 ] || exit $$rc; \
	set -o pipefail; t0=$$(date +%s); \
	{ echo "# LAB_HOME=$(LAB_AUTH_HOME) lab/run tests/lab/resv.sh  ($$(date -u +%F), Debian $$(cat $(LAB_AUTH_HOME)/kver) guest under QEMU, rxe0 on labnet0)"; \
	  LAB_HOME=$(LAB_AUTH_HOME) LAB_TIMEOUT=$(LAB_RESV_TIMEOUT) lab/run tests/lab/resv.sh 2>&1; } \
	  | tee tests/lab/last-resv-run.txt; rc=$$?; \
	echo "make lab-resv: rc=$$rc in $$(( $$(date +%s) - t0 )) s" | tee -a tests/lab/last-resv-run.txt; \
	exit $$rc

# lab-suites: the end-to-end, fault and hostile suites (issue 19) on verbs: in the lab guest,
# tests/lab/suites.sh runs them with BLOCKFABRIC_TEST_TRANSPORTS=verbs (NVMe-oF over the verbs
# provider on rxe0), once with one poll group and once with BLOCKFABRIC_TEST_REACTORS=2; the
# tests that speak the soft provider's or NVMe/TCP's wire themselves are skipped, saying why.
# Slow under TCG (tens of minutes): SUITES=..., PASSES="1" or "2", JOBS=n, SUITE_TIMEOUT=s
# (per pass), START_TIMEOUT=s (BLOCKFABRIC_TEST_START_TIMEOUT) and LAB_SUITES_ARGS="-k ..."
# (to pytest) narrow or tune it (handed to the script as arguments).  Output in
# tests/lab/last-suites-run.txt.  Skips where make lab does.  .ci/run runs pass 2 (every
# target with 2 poll groups, about 20 minutes under TCG); both passes take about 50.
LAB_SUITES_TIMEOUT ?= 7200
LAB_SUITES_ARGS ?=
LAB_SUITES_KNOBS = $(foreach v,SUITES PASSES JOBS SUITE_TIMEOUT START_TIMEOUT,\
                     $(if $($(v)),'$(v)=$($(v))'))
lab-suites: venv
	@rc=0; lab/setup || rc=$$?; \
	if [ $$rc = 77 ]; then echo "make lab-suites: SKIP: QEMU or the kernel cannot be installed here"; exit 0; fi; \
	[ $$rc = 0 ] || exit $$rc; \
	set -o pipefail; t0=$$(date +%s); \
	{ echo "# lab/run tests/lab/suites.sh $(strip $(LAB_SUITES_KNOBS) $(LAB_SUITES_ARGS))  ($$(date -u +%F), $$(git rev-parse --short HEAD), Debian $$(cat $${LAB_HOME:-/var/lib/rdma-lab}/kver) guest under QEMU, rxe0 on labnet0)"; \
	  LAB_TIMEOUT=$(LAB_SUITES_TIMEOUT) lab/run tests/lab/suites.sh $(LAB_SUITES_KNOBS) \
	    $(LAB_SUITES_ARGS) 2>&1; } \
	  | tee tests/lab/last-suites-run.txt; rc=$$?; \
	echo "make lab-suites: rc=$$rc in $$(( $$(date +%s) - t0 )) s" | tee -a tests/lab/last-suites-run.txt; \
	exit $$rc

# bench: fio through blockfabric's FUSE mount (thread and poll progress) against nbdkit +
# nbdfuse, nbdkit's Python plugin and tmpfs; then CPU per I/O and scaling (with flame
# graphs). About 20 minutes; results in benchmarks/results/.
bench: venv
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) benchmarks/compare $(BENCH_ARGS)
	$(PY) benchmarks/cost_per_io.py --systems all --rounds 3 --runtime 5
	$(PY) benchmarks/cpu_split.py --rounds 3 --out benchmarks/results
	$(PY) benchmarks/scaling.py --progress thread
	$(PY) benchmarks/scaling.py --progress poll

# bench-cost: the developer's loop, about a minute: target/host/fio CPU us per 4 KiB read
# through the poll mount and the pure-Python floor (found as benchmarks/compare finds it),
# interleaved rounds, medians, and issue 14's CPU goal as PASS/FAIL.  COST_ARGS="--systems
# mount-poll,nbd-memory --workloads randwrite-4k-qd16" and so on (see --help).
COST_ARGS ?= --systems mount-poll,floor --rounds 3 --runtime 3
bench-cost: venv
	$(PY) benchmarks/cost_per_io.py $(COST_ARGS) --out $(or $(COST_OUT),/tmp/blockfabric-cost)

# soak: several hosts x queues verifying crc32c for SOAK_DURATION seconds, a fault a minute.
SOAK_DURATION ?= 600
soak: venv
	$(PY) benchmarks/soak.py --duration $(SOAK_DURATION) $(SOAK_ARGS)

# fuzz: the stateful fuzzers of tests/hostile with fresh random seeds (printed; FUZZ_SEED=n
# replays one) for FUZZ_SECONDS each; failures are kept in .hypothesis/fuzz and tried first
# on the next run.  make test runs the same fuzzers for a few seconds from a fixed seed.
FUZZ_SECONDS ?= 300
fuzz: venv
	FUZZ_SECONDS=$(FUZZ_SECONDS) $(PY) -m pytest tests/hostile/test_fuzz_wire.py \
	    tests/hostile/test_fuzz_capsules.py -p no:cacheprovider $(PYTEST_ARGS)

bench-rdma: venv
	$(PY) benchmarks/rdma_bw.py --runs 5 --bytes 1G $(BENCH_ARGS)
	$(PY) benchmarks/rdma_bw.py --runs 5 --bytes 1G --progress poll $(BENCH_ARGS)

bench-rdma-lab: venv
	LAB_OUT=benchmarks/results lab/run tests/lab/bench-verbs.sh

# the product over verbs in the lab: blockfabric-target + blockfabric bench, 4 KiB QD1/QD16
# (BENCH_TAG names the report: verbs_lat-DATE-TAG.md/.json in benchmarks/results/)
BENCH_TAG ?= $(shell git rev-parse --short HEAD)
bench-verbs-lab: venv
	LAB_OUT=benchmarks/results LAB_TIMEOUT=$(LAB_TIMEOUT) lab/run tests/lab/bench-verbs-lat.sh \
	    --tag $(BENCH_TAG)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
