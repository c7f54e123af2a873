# Nakta on a CUDA PyTorch image: installs the package with its eval and test extras and runs the
# test suite by default (the GPU tests too when the container sees a GPU).
#   docker build -t nakta .
#   docker run --rm --gpus all nakta                                   # the tests
#   docker run --rm --gpus all nakta python -m speed_bench.run_all     # the speed benchmark
# Real assets (tokenizer, HellaSwag) are not baked in: mount them, e.g. `-v $PWD/../shared:/shared
# -e NAKTA_SHARED_DATA=/shared/data`.
ARG BASE_IMAGE=pytorch/pytorch:2.8.0-cuda12.8-cudnn9-runtime
FROM ${BASE_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Triton compiles its small launcher stubs with the system C compiler at first use; the runtime
# image has none.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /nakta
COPY . .
# torch and triton come with the base image; pip keeps them (the requirement is torch>=2.4).
RUN python -m pip install -e ".[eval,hf,test]"

CMD ["python", "-m", "pytest", "-q"]
