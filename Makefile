# The two commands of instride:  `make demo`  and  `make test`.
# Both work on a fresh Debian machine as root: they create .venv, install the package and
# what they need (apt packages included), then run.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# Debian packages the tests and benchmarks use: Redis (cluster metadata), iproute2 (emulated
# nodes in network namespaces), GROMACS (a second MD engine streaming over IMD), compilers
# for the preload library and its C/C++ tests, sshfs + sshd (the shared-file-system baseline
# of the benchmark: a real network file system between emulated nodes), slurm-wlm + munge (a real
# Slurm of emulated nodes for `instride job`).
APT_PACKAGES := redis-server iproute2 gromacs gcc g++ make procps sshfs openssh-server util-linux slurm-wlm munge

.PHONY: demo test lint bench clean system-deps

demo: $(BIN)/.installed-test
	$(BIN)/instride demo --out demo-output

test: system-deps $(BIN)/.installed-test
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/python -m pytest -q -p no:cacheprovider

lint: $(BIN)/.installed-test
	$(BIN)/ruff check src tests benchmarks

system-deps:
	@missing=""; \
	for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  if [ "$$(id -u)" != 0 ]; then echo "need root to apt-get install:$$missing" >&2; exit 1; fi; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	fi

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(BIN)/.installed-test: $(BIN)/python pyproject.toml setup.py $(wildcard csrc/preload/*.c csrc/preload/*.h)
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@

clean:
	rm -rf $(VENV) build src/*.egg-info demo-output
