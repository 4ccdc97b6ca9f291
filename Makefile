# Surge: two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
GEN    := services/contract/gen
PROTOS := $(wildcard proto/surge/v1/*.proto)

.PHONY: setup tools proto contracts demo test test-compose lint format up down clean bench bench-faults bench-quiet-faults bench-goodput bench-scale bench-control bench-control-start bench-rank-start bench-stack-cost bench-profile bench-generate bench-scheduler bench-lm-eval bench-event-tail

setup: $(STAMP) $(GEN)/.stamp

# torch==2.13.0 first: it comes from a local CPU wheel; anything asking for torch later is satisfied.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0 numpy
	$(BIN)/pip install -q -e '.[dev,s3test]'
	touch $(STAMP)

proto: $(STAMP)
	rm -rf $(GEN)/surge $(GEN)/.stamp
	$(MAKE) $(GEN)/.stamp

$(GEN)/.stamp: $(PROTOS) $(STAMP)
	mkdir -p $(GEN)
	$(BIN)/python -m grpc_tools.protoc -Iproto \
	  --python_out=$(GEN) --grpc_python_out=$(GEN) \
	  --plugin=protoc-gen-mypy=$(BIN)/protoc-gen-mypy --mypy_out=quiet:$(GEN) \
	  $(PROTOS)
	touch $@

# docs/permissions.md from the proto route options and services/contract/red_lines.yaml
# (CI fails when the committed file is stale: tests/contract/test_permissions_doc.py), and
# docs/exceptions.md from services/contract/exceptions.yaml (tests/redlines/test_communication.py).
contracts: setup
	$(BIN)/python -m services.contract.permissions_doc
	$(BIN)/python -m services.contract.handlers_gen
	$(BIN)/python -m services.contract.exceptions_doc

demo: setup
	$(BIN)/surgectl demo examples/jobs/demo.yaml

# Two test processes (pytest-xdist), each taking a whole file at a time so that a module's
# one stack serves all its tests (or a whole group of files that share one stack:
# tests/conftest.py STACK_GROUPS, its scheduler), keep both of CI's 2 cores busy (serial, TEST_WORKERS=0:
# about 26 min in CI; two processes on clean clones under load: 23 min, 42 min). 0: serial.
# The files go out longest first (tests/conftest.py LONGEST_FIRST), not by xdist's count.
TEST_WORKERS ?= 2
test: setup tools
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=30

# Debian tools some tests use, installed where missing: promtool and prometheus (metrics
# and config checks, a real scrape), docker-compose (`docker-compose config -q`). Tests that
# need one skip, saying why, when it could not be installed. chromium and chromium-driver:
# the dashboard's browser test (tests/dashboard/browser.py), which fails without them
# (SURGE_SKIP_BROWSER=1 opts a machine out).
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
tools:
	@missing=""; \
	{ command -v promtool && command -v prometheus; } >/dev/null || missing="$$missing prometheus"; \
	command -v docker-compose >/dev/null || missing="$$missing docker-compose"; \
	{ command -v chromium && command -v chromedriver; } >/dev/null || missing="$$missing chromium chromium-driver"; \
	if [ -n "$$missing" ]; then \
	  echo "installing$$missing (apt-get)"; \
	  { $(SUDO) apt-get update -q && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q --no-install-recommends $$missing; } >/dev/null \
	    || echo "warning: could not install$$missing; the tests that need it will skip (the browser test fails)"; \
	fi

# docker-compose.yml for real, not part of `make test` (about 12 min the first time, 6 of
# them images; 6-7 min once built, on a quiet 2-core host): deploy/podman/compose_test.sh
# builds a Debian base image locally (no registry is pulled), runs the README's compose
# commands with podman-compose, trains the demo job in the stack, reads surge_train_loss
# from its Prometheus and removes all it started. Installed where missing: podman, runc,
# netavark, aardvark-dns, iptables (netavark's firewall driver; without it every build
# step that makes a network fails with "netavark: No such file or directory") and
# mmdebstrap (apt-get), and podman-compose (pip, into the venv);
# podman's settings: deploy/podman/containers.conf.
COMPOSE_APT := podman runc netavark aardvark-dns iptables slirp4netns uidmap catatonit mmdebstrap
test-compose: setup
	@missing=""; \
	for t in podman runc netavark iptables mmdebstrap; do command -v $$t >/dev/null || [ -x /usr/lib/podman/$$t ] || missing="$$missing $$t"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing$$missing (apt-get)"; \
	  { $(SUDO) apt-get update -q && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q --no-install-recommends $(COMPOSE_APT); } >/dev/null; \
	fi
	@$(BIN)/podman-compose --version >/dev/null 2>&1 || $(BIN)/pip install -q 'podman-compose==1.6.0'
	PATH="$(CURDIR)/$(BIN):$$PATH" deploy/podman/compose_test.sh

# Benchmarks (not tests): Surge against torchrun, data path, checkpoints, control plane
# (bench/run.py; BENCH_QUICK=1 for a ~3 min pass), faults (bench/faults.py) and goodput
# under a fault schedule (bench/goodput.py; BENCH_QUICK=1: 4 min per system; flags in
# GOODPUT_ARGS, e.g. "--policy restart_ranks --only surge"). Results in bench/results/*.json,
# a markdown table on stdout; see README "Benchmarks".
bench: setup
	$(BIN)/python bench/run.py

bench-faults: setup
	$(BIN)/python bench/faults.py
	$(BIN)/python bench/recovery_versions.py

# Issue 29's quiet faults: detection times, false positives, the replica check's cost
# (bench/quiet_faults.py; BENCH_QUICK=1 for one trial of each).
bench-quiet-faults: setup
	$(BIN)/python bench/quiet_faults.py

bench-goodput: setup
	$(BIN)/python bench/goodput.py $(GOODPUT_ARGS)

# The scale test bed (issue 27 item 7): 64, 128 and 256 simulated ranks (services/rank/
# simulated: torch-free processes speaking the real protocols, compute replaced by a sleep)
# through a real stack on this machine, about 10 min; flags in SCALE_ARGS (e.g.
# "--world-sizes 64 --steps 20"). Results in bench/results/scale.json, a table on stdout.
bench-scale: setup
	$(BIN)/python bench/scale.py $(SCALE_ARGS)

# The control-plane bench (issue 28 item 7): simulated node agents (real gRPC clients, no
# torch) against the real control: 1,024 nodes x 8 ranks at 1 step/s, 10,000 agents at 1 Hz,
# a control SIGKILL + start with 3,000 connected (false deaths). Flags in CONTROL_ARGS (e.g.
# "--nodes 128 --agents 1000 --restart-agents 1000"; BENCH_QUICK=1 for those sizes).
# Results in bench/results/control.json, a table on stdout.
bench-control: setup
	$(BIN)/python bench/control_bench.py $(CONTROL_ARGS)

# A job's start in process (bench/control_start.py): 64 x 8 ranks' ready events -> RUNNING, the
# journal commits it costs, and the LaunchRanks bytes at 64, 512, 8,192 ranks (issue 28).
bench-control-start: setup
	$(BIN)/python bench/control_start.py $(START_ARGS)

# The stack's own CPU per training step (bench/stack_cost.py, issue 28 item 3; goal <= 1 % of a
# step): the demo model at dp 2 on a real stack, every non-rank process and the ranks' side
# threads read from /proc over a window of steps; flags in STACK_COST_ARGS (e.g. "--window 100").
# About 3 min. Results in bench/results/stack_cost.json, a table on stdout.
bench-stack-cost: setup
	$(BIN)/python bench/stack_cost.py $(STACK_COST_ARGS)

# The scheduler bench (bench/scheduler_bench.py, issue 30 item 7): the pure scheduling policy
# (services/control/scheduler/) on a simulated cluster, no processes: one decision over 1,000
# queued jobs of 50 teams (p50/p99), and a simulated day under plain FIFO and under fair share
# with quotas (utilisation, waits per team). Flags in SCHEDULER_ARGS (e.g. "--slots 256
# --load 1.1"). About 10 s. Results in bench/results/scheduler.json, a table on stdout.
bench-scheduler: setup
	$(BIN)/python bench/scheduler_bench.py $(SCHEDULER_ARGS)

# The dashboard at scale (bench/dashboard_scale.py, issue 31): a job page and a 2-job compare
# page of a synthetic N steps x R ranks metrics file read through a real store: bytes, seconds,
# the store's and the dashboard's peak RSS. Flags in DASHBOARD_ARGS (e.g. "--sizes 10000x8").
# A few minutes (writing the 100,000 x 64 file, 3.8 GB, is most of it). Results in
# bench/results/dashboard_scale.json, a table on stdout.
bench-dashboard: setup
	$(BIN)/python bench/dashboard_scale.py $(DASHBOARD_ARGS)

# A job page's events from control's journal (bench/event_tail.py): the newest 200 of a
# 100,000-event job in a real JobStore, the whole-history read before JobQuery.tail beside.
# Seconds. Flags in EVENT_TAIL_ARGS. About 20 s. Results in bench/results/event_tail.json.
bench-event-tail: setup
	$(BIN)/python bench/event_tail.py $(EVENT_TAIL_ARGS)

# What `surgectl profile` costs a running job (bench/profile_overhead.py): the profiled steps'
# time and the job's tokens/s against the steps before, the export at the boundary after, each
# rank's trace size.
bench-profile: setup
	$(BIN)/python bench/profile_overhead.py $(PROFILE_ARGS)

# `surgectl generate`'s decoding (bench/generate_speed.py): the demo model's tokens/s with the KV
# cache, recomputing the window per token (before the cache), and a batch of prompts; seconds.
bench-generate: setup
	$(BIN)/python bench/generate_speed.py $(GENERATE_ARGS)

# A real lm-evaluation-harness run through `surgectl evaluate` (bench/lm_eval_hook.py): a venv of
# its own with lm-eval (LM_EVAL_ARGS "--work DIR", default /tmp/surge-lm-eval; never this
# .venv), two local lm-eval tasks over the standard library's source (no download), a small
# BPE job trained on a stack of its own, evaluated through the queue; the scores as `status`
# shows them. Minutes, plus the venv's install the first time. Results in bench/results/lm_eval_hook.json.
bench-lm-eval: setup
	$(BIN)/python bench/lm_eval_hook.py $(LM_EVAL_ARGS)

# Rank start-up (bench/rank_start.py): ranks forked from the node agent's rank fork server
# against new interpreters, N dp=2 jobs a mode (flags in RANK_START_ARGS, e.g. "--jobs 5");
# about 3 min. Results in bench/results/rank_start.json.
bench-rank-start: setup
	$(BIN)/python -m bench.rank_start $(RANK_START_ARGS)

# The import contracts (layers), ruff's linter, and ruff's formatter as a check: CI fails on
# code `make format` would change.
lint: setup
	$(BIN)/lint-imports
	$(BIN)/ruff check services tests bench
	$(BIN)/ruff format --check services tests bench

format: setup
	$(BIN)/ruff format services tests bench

up: setup
	$(BIN)/surgectl up

down:
	$(BIN)/surgectl down

clean:
	rm -rf $(GEN)/surge $(GEN)/.stamp .surge
