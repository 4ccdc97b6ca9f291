# Surge: two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
GEN    := services/contract/gen
PROTOS := $(wildcard proto/surge/v1/*.proto)

.PHONY: setup proto contracts demo test lint up down clean

setup: $(STAMP) $(GEN)/.stamp

# torch==2.13.0 first: it comes from a local CPU wheel; anything asking for torch later is satisfied.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0 numpy
	$(BIN)/pip install -q -e '.[dev]'
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
# (CI fails when the committed file is stale: tests/contract/test_permissions_doc.py).
contracts: setup
	$(BIN)/python -m services.contract.permissions_doc

demo: setup
	$(BIN)/surgectl demo examples/jobs/demo.yaml

test: setup
	$(BIN)/python -m pytest -q

lint: setup
	$(BIN)/lint-imports

up: setup
	$(BIN)/surgectl up

down:
	$(BIN)/surgectl down

clean:
	rm -rf $(GEN)/surge $(GEN)/.stamp .surge
