#!/usr/bin/env bash
# Fresh machine -> installed pdserve -> the whole test suite (unit + end-to-end with real processes).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
# A real Prometheus for tests/test_dashboard.py: Debian's package, where apt is there and we may use it (the test
# skips, saying why, where it is not).
if ! command -v prometheus >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  { timeout 300 apt-get install -y -q --no-install-recommends prometheus >/dev/null 2>&1 \
    || { timeout 300 apt-get update -q >/dev/null 2>&1 && timeout 300 apt-get install -y -q --no-install-recommends prometheus >/dev/null 2>&1; }; } \
    || echo "prometheus could not be installed: tests/test_dashboard.py will skip"
fi
export UCX_TLS=tcp,self UCX_NET_DEVICES=lo UCX_WARN_UNUSED_ENV_VARS=n TRITON_INTERPRET=1
exec .venv/bin/python -m pytest -q "$@"
