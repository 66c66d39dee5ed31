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
DEB_PKGS := python3-venv fuse3 libfuse3-3 fio python3-pyverbs rdma-core \
            ibverbs-providers iproute2 util-linux e2fsprogs strace

.PHONY: all deps venv test demo clean help

all: help

help:
	@echo "make demo   set up, start a ramdisk target on the soft provider, mount it, benchmark, clean up"
	@echo "make test   set up and run the full test suite"
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

# The end-to-end suite runs a second time with the soft provider's engine driven by the
# reactors themselves (poll progress) instead of its own thread: both modes are supported.
test: venv
	$(PY) -m pytest $(PYTEST_ARGS)
	BLOCKFABRIC_SOFT_PROGRESS=poll $(PY) -m pytest -q tests/e2e $(PYTEST_ARGS)

demo: venv
	$(PY) scripts/demo.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
