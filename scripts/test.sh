#!/usr/bin/env bash
# Fresh machine -> installed pdserve -> the whole test suite (unit + end-to-end with real processes).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export UCX_TLS=tcp,self UCX_NET_DEVICES=lo UCX_WARN_UNUSED_ENV_VARS=n TRITON_INTERPRET=1
exec .venv/bin/python -m pytest -q "$@"
