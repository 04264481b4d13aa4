#!/usr/bin/env bash
# Fresh machine -> installed pdserve -> the test suite (all tiers; pass pytest arguments to pick one, README).
# The install runs when .venv is missing or what it is built from changed since the last install by this script
# (the install script, the package and SDK definitions, the protos, the C kernels); PDSERVE_REINSTALL=1 forces it.
set -euo pipefail
cd "$(dirname "$0")/.."
stamp=.venv/.installed-from
inputs=$(cat scripts/install.sh pyproject.toml setup.py sdk/pyproject.toml sdk/setup.py proto/pdserve/v1/*.proto \
         kernels/*.c kernels/*.cpp kernels/*.h | sha256sum | cut -d' ' -f1)
if [ "${PDSERVE_REINSTALL:-0}" = 1 ] || [ ! -x .venv/bin/python ] || [ "$(cat "$stamp" 2>/dev/null)" != "$inputs" ]; then
  bash scripts/install.sh
  echo "$inputs" > "$stamp"
else
  echo "test.sh: .venv is current (PDSERVE_REINSTALL=1 reinstalls)"
fi
# Real servers the tests start: Prometheus (tests/deploy/test_dashboard.py) and Redis (the shared KV offload tier's
# tests): Debian's packages, where apt is there and we may use it (those tests skip, saying why, where it is not).
for pkg in prometheus:prometheus redis-server:redis-server; do
  binary=${pkg%%:*}; package=${pkg##*:}
  if ! command -v "$binary" >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    echo "test.sh: installing Debian's $package for the tests that start one"
    { timeout 300 apt-get install -y -q --no-install-recommends "$package" >/dev/null 2>&1 \
      || { timeout 300 apt-get update -q >/dev/null 2>&1 \
           && timeout 300 apt-get install -y -q --no-install-recommends "$package" >/dev/null 2>&1; }; } \
      || echo "$package could not be installed: the tests that need it will skip"
  fi
done
export UCX_TLS=tcp,self UCX_NET_DEVICES=lo UCX_WARN_UNUSED_ENV_VARS=n TRITON_INTERPRET=1
# OpenMP threads that wait asleep, not spinning: the test processes and the servers they start share 2 cores, and a
# spinning thread takes the CPU the others need (the model tier in two processes: 104 s spinning, 34 s asleep).
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
# Two pytest processes (pytest-xdist), each module on one of them (its module-scoped clusters start once): the
# end-to-end tests spend much of their time waiting on processes they started, which the other process fills.
# PDSERVE_TEST_PROCESSES=0 runs everything in this process (as does `-p no:xdist`).
exec .venv/bin/python -m pytest -q -n "${PDSERVE_TEST_PROCESSES:-2}" --dist loadscope "$@"
