#!/usr/bin/env bash
# Fresh machine -> running disaggregated cluster (coordinator + prefill + decode on localhost) + one streamed demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec .venv/bin/pdserve serve --disaggregated --port 0 --demo "$@"
