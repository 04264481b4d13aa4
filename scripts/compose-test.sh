#!/usr/bin/env bash
# Deployment check (not in CI: it builds images): start dockerd if needed, build the base and pdserve images, bring
# the CPU compose topology up, stream a greedy request and compare it with HF transformers on the same weights,
# scale decode to 2 and check both decode workers serve, tear down. Prints build and time-to-healthy figures.
#   usage: [NO_CACHE=1] bash scripts/compose-test.sh     (as root on a machine of ours; installs what it needs)
set -euo pipefail
cd "$(dirname "$0")/.."
PROJECT=pdserve-compose-test
export PDSERVE_PORT="${PDSERVE_PORT:-50151}" PDSERVE_CLUSTER_SECRET="${PDSERVE_CLUSTER_SECRET:-$(openssl rand -hex 16)}"
[ -x .venv/bin/python ] || bash scripts/install.sh

if ! docker info >/dev/null 2>&1; then
  command -v dockerd >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker.io docker-compose debootstrap
  echo "starting dockerd (log: /tmp/pdserve-dockerd.log)"
  (dockerd >/tmp/pdserve-dockerd.log 2>&1 &)
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
fi
if ! docker compose version >/dev/null 2>&1 && ! command -v docker-compose >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker-compose  # a docker engine without compose
fi
if docker compose version >/dev/null 2>&1; then COMPOSE=(docker compose); else COMPOSE=(docker-compose); fi
echo "compose: $("${COMPOSE[@]}" version | head -1)"

t0=$SECONDS
bash deploy/build-base.sh
t1=$SECONDS
BUILD_ARGS=()
for dir in ${PIP_FIND_LINKS:-} /opt/wheels; do  # a local CPU torch wheel, when this machine has one
  [ -d "$dir" ] && cp -n "$dir"/torch-*+cpu-*.whl deploy/wheels/ 2>/dev/null || true
done
[ -n "${PIP_CERT:-}" ] && cp "$PIP_CERT" deploy/certs/ca.pem  # pip behind a TLS-inspecting proxy
for var in PIP_INDEX_URL PIP_EXTRA_INDEX_URL TORCH_CPU_INDEX; do  # this machine's indexes, when set, for the build
  [ -n "${!var:-}" ] && BUILD_ARGS+=(--build-arg "$var=${!var}")
done
trap 'rm -f deploy/wheels/*.whl deploy/certs/ca.pem; "${COMPOSE[@]}" -p $PROJECT down -v --remove-orphans >/dev/null 2>&1 || true' EXIT
[ -n "${NO_CACHE:-}" ] && BUILD_ARGS+=(--no-cache)  # NO_CACHE=1: time a cold build
docker build --network host -q "${BUILD_ARGS[@]}" -f deploy/Dockerfile -t pdserve:cpu . >/dev/null
t2=$SECONDS
echo "base image: $((t1 - t0)) s; pdserve image: $((t2 - t1)) s; size: $(docker image inspect pdserve:cpu --format '{{.Size}}' | awk '{printf "%.2f GB", $1/1e9}')"

wait_healthy() {  # service -> seconds waited
  local start=$SECONDS id
  for _ in $(seq 600); do
    id=$("${COMPOSE[@]}" -p $PROJECT ps -q "$1" | head -1)
    [ -n "$id" ] && [ "$(docker inspect -f '{{.State.Health.Status}}' "$id")" = healthy ] && { echo $((SECONDS - start)); return; }
    sleep 1
  done
  echo "$1 never became healthy" >&2; "${COMPOSE[@]}" -p $PROJECT logs --tail 50 >&2; exit 1
}
t3=$SECONDS
"${COMPOSE[@]}" -p $PROJECT up -d
wait_healthy coordinator >/dev/null
echo "up -d to coordinator healthy (workers healthy first): $((SECONDS - t3)) s"

.venv/bin/python - "$PDSERVE_PORT" <<'PY'
import sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from pdserve_server.cli.models import resolve_model
from pdserve import Client, SamplingParams

model_dir = str(resolve_model(None))
prompt = "The capital of France is"
with Client(f"127.0.0.1:{sys.argv[1]}") as c:
    out = c.complete(prompt, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
tok = AutoTokenizer.from_pretrained(model_dir)
ids = torch.tensor([tok(prompt)["input_ids"]])
hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).generate(
    ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)[0, ids.shape[1]:].tolist()
print(f"compose: {out.text!r} (TTFT {out.timings['ttft_ms']:.0f} ms, transfer {out.timings['transfer_ms']:.1f} ms)")
assert out.token_ids == hf, (out.token_ids, hf)
print("greedy output equals HF transformers token for token")
PY

"${COMPOSE[@]}" -p $PROJECT up -d --scale decode=2 --no-recreate
wait_healthy decode >/dev/null
.venv/bin/python - "$PDSERVE_PORT" <<'PY'
import sys, time
from pdserve import Client, SamplingParams
with Client(f"127.0.0.1:{sys.argv[1]}") as c:
    deadline = time.monotonic() + 120
    while c.model_info().num_decode_workers < 2:
        assert time.monotonic() < deadline, "the second decode worker never joined"
        time.sleep(1)
    for i in range(6):
        c.complete([5 + i, 6, 7], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
print("2 decode workers live")
PY
for id in $("${COMPOSE[@]}" -p $PROJECT ps -q decode); do
  n=$(docker logs "$id" 2>&1 | grep -c "joined=" || true)
  echo "decode container ${id:0:12}: $n batch joins"
  [ "$n" -gt 0 ] || { echo "a decode worker served nothing" >&2; exit 1; }
done
echo "compose test passed in $((SECONDS - t0)) s"
