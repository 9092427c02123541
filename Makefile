# ntp-manager: every set-up step lives here, so a fresh machine needs only `make demo` or `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo slow-demo ha-demo test bench proto docs lint venv clean gpu-wheels

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# Reinstall when the dependency list changes. torch is pinned to 2.13.0 first so that nothing
# later can resolve a newer (CUDA, multi-GB) build. Both of this repository's distributions are
# installed editable from this checkout -- nonuniform-tp-manager (.) and nonuniform-tp-agent
# (agent/) -- never by name from the index, where `ntp-manager` is another project with the same
# import package (docs/install.md); a distribution of that name left in the venv (this project's
# own before it was renamed, or the other one) is removed first, since the two overwrite each other.
$(STAMP): pyproject.toml setup.py agent/pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip uninstall -q -y ntp-manager 2>/dev/null || true
	$(BIN)/pip install -q -e ".[manager,worker,dev]" -e ./agent
	@touch $(STAMP)

# The dashboard's browser test drives Debian's chromium through Playwright. Installed when we can
# (root with apt); otherwise that one test skips and says why.
CHROMIUM_STAMP := $(VENV)/.chromium
$(CHROMIUM_STAMP): | $(BIN)/python
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing chromium for the dashboard browser test"; \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1 || \
	    { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1; } || \
	    echo "chromium could not be installed: the browser test will be skipped"; \
	  else echo "no chromium and no root apt: the browser test will be skipped"; fi; }
	@touch $(CHROMIUM_STAMP)

# The real-Slurm tests (tests/integration/test_slurm.py) run Debian's Slurm and munge on loopback.
# Installed when we can (root with apt); otherwise those tests skip and say why.
SLURM_STAMP := $(VENV)/.slurm
$(SLURM_STAMP): | $(BIN)/python
	@command -v slurmctld >/dev/null 2>&1 && command -v slurmd >/dev/null 2>&1 && command -v sbatch >/dev/null 2>&1 \
	  && command -v munged >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing Slurm and munge for the Slurm tests"; \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null 2>&1 || \
	    { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null 2>&1; } || \
	    echo "Slurm could not be installed: the Slurm tests will be skipped"; \
	  else echo "no Slurm and no root apt: the Slurm tests will be skipped"; fi; }
	@touch $(SLURM_STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m ntp_manager.demos.demo

# Two managers on PostgreSQL (a fresh database on NTP_HA_DEMO_POSTGRES, default the local server),
# the leader SIGKILLed while the demo job trains; no Docker needed (docker-compose.yml: the same
# with containers, `docker compose up`).
ha-demo: $(STAMP)
	$(BIN)/python -m ntp_manager.demos.ha_demo

# Fail-slow (issue 21): one rank made slow, detected, its GPU degraded, the layout changed.
slow-demo: $(STAMP)
	$(BIN)/python -m ntp_manager.demos.demo_slow

lint: $(STAMP)
	$(BIN)/ruff check ntp_manager agent migrations tests bench examples tools
	$(BIN)/mypy ntp_manager agent/ntp_agent tools  # pyproject's `files`, and the docs tools (not a STAMP input)

# Tests are independent (own ports, own databases): one worker per core, whole files kept together
# so that module-scoped fixtures are built once.
TEST_WORKERS ?= auto
test: lint $(CHROMIUM_STAMP) $(SLURM_STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

bench: $(STAMP)
	$(BIN)/python bench/run_all.py

proto: $(STAMP)
	$(BIN)/python -m ntp_manager.protogen

# docs/settings.md from the settings classes (tests/unit/test_docs.py fails when it is stale)
docs: $(STAMP)
	$(BIN)/python tools/settings_doc.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

# Wheels to carry to a lent GPU machine for bench/gpu_session.sh (docs/gpu-runbook.md): into .whl/
gpu-wheels: $(STAMP)
	bash bench/gpu_wheels.sh
