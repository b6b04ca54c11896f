# The two commands of instride:  `make demo`  and  `make test`.
# Both work on a fresh Debian machine as root: they create .venv, install the package and
# what they need (apt packages included), then run.

# The interpreter the venv is made from: Debian's own python3 where it is there (the machine
# these commands are for; built with PGO and LTO, libpython linked in: instride's per-frame
# Python took 15–25 % less CPU on it than on a default pyenv build that a PATH shim may put first),
# else python3 from PATH. `make test PYTHON=python3.12` (or any interpreter) to choose; remove
# .venv first to change it.
PYTHON ?= $(firstword $(wildcard /usr/bin/python3) python3)
VENV   := .venv
BIN    := $(VENV)/bin
# Debian packages the tests and benchmarks use: Redis (cluster metadata), iproute2 (emulated
# nodes in network namespaces), GROMACS and LAMMPS (MD engines streaming over IMD v2), compilers
# for the preload library and its C/C++/Fortran tests, sshfs + sshd (the shared-file-system baseline
# of the benchmark: a real network file system between emulated nodes), UCX (the ucx
# transport's C engine is built against libucx-dev; ucx-utils has ucx_info/ucx_perftest),
# slurm-wlm + munge (a real Slurm of emulated nodes for `instride job`), locales (the source
# of a decimal-comma locale the C settings parser is tested under).
# BUILD_PACKAGES: what creating .venv and `pip install -e .` need: python3-venv (Debian's
# python3 has no ensurepip without it), a C compiler for the preload library (without
# libc6-dev, which apt does not install with gcc under --no-install-recommends, gcc finds no
# headers), OpenSSL's and xxhash's headers for the tcp transport's C engine (libinstride_tcp.so:
# HMAC-SHA256 from libcrypto, xxh3 inlined); `make demo` installs only these.
BUILD_PACKAGES := python3-venv gcc libc6-dev libssl-dev libxxhash-dev
APT_PACKAGES := $(BUILD_PACKAGES) redis-server iproute2 gromacs lammps g++ gfortran make procps sshfs openssh-server util-linux libucx-dev ucx-utils slurm-wlm munge locales

.PHONY: demo test lint bench clean system-deps build-deps

# apt-get install the packages of $(1) that are missing (as root; Debian)
define apt_install
	@missing=""; \
	for p in $(1); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  if [ "$$(id -u)" != 0 ]; then echo "need root to apt-get install:$$missing" >&2; exit 1; fi; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	fi
endef

demo: build-deps $(BIN)/.installed-test
	$(BIN)/instride demo --out demo-output

test: system-deps $(BIN)/.installed-test
	@# libucx-dev installed after the venv was made (`make demo` first): build the ucx engine now
	@if [ -e /usr/include/ucp/api/ucp.h ] && [ ! -e src/instride/libinstride_ucx.so ]; then \
	  $(BIN)/python -m pip install -q -e '.[test]'; fi
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/python -m pytest -q -p no:cacheprovider

lint: $(BIN)/.installed-test
	$(BIN)/ruff check src tests benchmarks

system-deps:
	$(call apt_install,$(APT_PACKAGES))

build-deps:
	$(call apt_install,$(BUILD_PACKAGES))

$(BIN)/python: | build-deps
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# the package build compiles C: the compiler comes first (order-only: it never forces a rebuild)
$(BIN)/.installed-test: $(BIN)/python pyproject.toml setup.py $(wildcard csrc/*/*.c csrc/*/*.h include/instride/*) | build-deps
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@

clean:
	rm -rf $(VENV) build src/*.egg-info demo-output
