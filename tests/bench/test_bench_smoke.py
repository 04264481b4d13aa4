"""Smoke runs of the benchmark harness (not benchmarks): a few requests through the sweep against pdserve and the
naive baseline, and one small KV transfer per connector, on the tiny model. They check the harness works end to
end: processes start and stop, every request completes, the outputs (JSON, Markdown, PNG) are written."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e


def _run(args, tmp_path, timeout=600, **env_set):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | env_set
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


def test_sweep_smoke(tiny_model_dir, tmp_path):
    out = tmp_path / "sweep"
    stdout = _run(["bench/sweep.py", "--model-dir", str(tiny_model_dir), "--systems", "naive,llamacpp",
                   "--llama-server", str(tmp_path / "no-llama-server"), "--workload", "seed",
                   "--variant", "colocated-x2=colocatedx2:",  # two colocated workers behind one coordinator
                   "--variant", "pdserve-disagg=disagg:|--local-prefill-tokens 64",  # coordinator flags after the |
                   "--concurrency", "1,3", "--num-requests", "3", "--output-len", "5",
                   "--threads", "1", "--rounds", "2", "--out-dir", str(out)], tmp_path, OMP_WAIT_POLICY="PASSIVE")
    results = json.loads((out / "results.json").read_text())
    assert set(results["systems"]) == {"pdserve-disagg", "naive", "colocated-x2"}
    # two rounds, the second in the reverse order; a level's row is the median of both, its counts summed
    started = [(run["round"], run["system"]) for run in results["order"]]
    first = [s for r, s in started if r == 0]
    assert [s for r, s in started if r == 1] == first[::-1] and "naive" in first
    assert [set(r) for r in results["rounds"]] == [set(results["systems"])] * 2
    assert not (out / "partial.json").exists()  # written after each system, gone once results.json is
    # the OpenMP setting every system inherits (it halves a CPU engine's batch-1 speed) is recorded and named
    assert results["config"]["thread_env"]["OMP_WAIT_POLICY"] == "PASSIVE"
    assert "inherits OMP_WAIT_POLICY=PASSIVE" in stdout
    assert (out / "logs" / "colocated-1.log").exists()  # the variant's second worker started
    # a peer that cannot start is said, with the round (it may run in another), and the rest run
    assert all("no-llama-server" in results["not_run"][f"llamacpp (round {r})"] for r in (1, 2))
    assert results["config"]["workload"] == "seed" and results["config"]["input_len"] > 10
    assert "pdserve-disagg=disagg:|--local-prefill-tokens 64" in results["config"]["variants"]  # how to rerun it
    for name, rows in results["systems"].items():
        assert [r["concurrency"] for r in rows] == [1, 3]
        for r in rows:
            assert (r["rounds"], r["completed"], r["failed"], r["output_tokens"]) == (2, 6, 0, 30), (name, r)
            assert 0 < r["ttft_ms_p50"] <= r["e2e_ms_p50"] and r["itl_ms_p50"] > 0
            assert r["machine_fraction"] > 0 and r["gemm_flop_s"] > 0  # against the fp32 GEMM rate at c rows
            # weight bytes/s over copy bandwidth, where one step reads every weight per token
            assert (r.get("bandwidth_fraction", 0) > 0) == (r["concurrency"] == 1), (name, r)
    assert results["config"]["copy_bytes_s"] > 1e8
    assert set(results["ratios"]["pdserve-disagg"]) == set(results["ratios"]["colocated-x2"]) == {"1", "3"}
    assert "**naive**" in (out / "results.md").read_text()
    assert (out / "results.png").stat().st_size > 10_000


def test_transfer_rate_smoke(tiny_model_dir, tmp_path):
    out = tmp_path / "kv.json"
    _run(["bench/transfer_rate.py", "--model-dir", str(tiny_model_dir), "--prompts", "40", "--repeats", "1",
          "--out", str(out)], tmp_path)
    (row,) = json.loads(out.read_text())
    assert row["blocks"] == 3 and row["plain_socket_mib_s"] > 0 and row["prefill_ms"] > 0
    assert row["tcp_mib_s"] > 0 and 0 < row["tcp_ttft_share"] < 1
    # UCX over its TCP transport, and with its shared-memory transports
    assert row["ucx[tcp,self]_mib_s"] > 0 and row["ucx[sm,tcp,self]_mib_s"] > 0
    # every connector again through the layer-wise streaming protocol
    assert all(row[f"{name}+layers_mib_s"] > 0 for name in ("tcp", "ucx[tcp,self]", "nccl[gloo]"))


def test_layerwise_smoke(tiny_model_dir, tmp_path):
    out = tmp_path / "layerwise.json"
    _run(["bench/layerwise.py", "--model-dir", str(tiny_model_dir), "--lengths", "40", "--repeats", "1",
          "--rounds", "1", "--out", str(out)], tmp_path)
    (row,) = json.loads(out.read_text())["rows"]
    # The first two tokens may reach the client in one read on a loaded machine: a gap of 0 is a measurement.
    assert row["prompt_tokens"] == 40 and row["gap_ms_off"] >= 0 and row["gap_ms_on"] >= 0
    assert row["transfer_ms_off"] > 0 and row["transfer_ms_on"] > 0  # the Final waits for the transfer report


def test_quality_smoke(tiny_model_dir, tmp_path):
    out = tmp_path / "quality.json"
    _run(["bench/quality.py", "--model-dir", str(tiny_model_dir), "--ppl-tokens", "80", "--out", str(out)], tmp_path)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["dtype"], r["quantization"], r["kv_cache_dtype"]) for r in rows] == [
        ("float32", "none", "auto"), ("float32", "none", "bfloat16"), ("float32", "w8a8_int8", "auto"),
        ("float32", "w8a8_int8", "bfloat16"), ("bfloat16", "none", "auto"), ("bfloat16", "int8", "auto"),
        ("bfloat16", "int4", "auto")]  # gguf skipped: the tiny model is no GGUF's
    fp32, bf16_kv, w8a8 = rows[0], rows[1], rows[2]
    assert fp32["agreement_vs_fp32"] == 1.0 and fp32["agreement_long_vs_fp32"] == 1.0
    assert all(r["perplexity"] > 1 for r in rows if r["quantization"] != "w8a8_int8" and r["kv_cache_dtype"] == "auto")
    # a bf16 cache rounds K/V only: near fp32, not equal
    for key in ("decode_perplexity", "prefill_perplexity"):
        assert bf16_kv[key] != fp32[key] and abs(bf16_kv[key] / fp32[key] - 1) < 0.05
    # the engine fed one token a step, or as one prefill, computes what HF's one forward pass does (fp32: the same
    # model, exactly)
    assert all(r["decode_perplexity"] > 1 and r["prefill_perplexity"] > 1 for r in rows)
    assert abs(fp32["decode_perplexity"] / fp32["perplexity"] - 1) < 1e-3
    assert abs(fp32["prefill_perplexity"] / fp32["perplexity"] - 1) < 1e-3
    # w8a8_int8 computes every row of a model without GGUF weights (the tiny one) in int8, one-token decode steps
    # too: near fp32, not equal
    for key in ("decode_perplexity", "prefill_perplexity"):
        assert w8a8[key] != fp32[key] and abs(w8a8[key] / fp32[key] - 1) < 0.1


def test_speculative_smoke(tiny_model_dir, tmp_path):
    out = tmp_path / "spec.json"
    _run(["bench/speculative.py", "--model-dir", str(tiny_model_dir), "--batches", "2", "--k", "3",
          "--workloads", "docs,rewrite", "--out", str(out)], tmp_path)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["workload"], r["k"]) for r in rows] == [("docs", 0), ("docs", 3), ("rewrite", 0), ("rewrite", 3)]
    assert all(r["same_output"] and r["tokens"] > 0 for r in rows)
    assert rows[0]["draft"] == 0


def test_sliding_window_smoke(tmp_path):
    """Four requests of 7 blocks each in a 16-block budget: two at a time unless blocks behind the 16-token window
    go back; the run that gives them back batches more and generates the same tokens."""
    out = _run(["bench/sliding_window.py", "--requests", "4", "--prompt", "96", "--out-tokens", "8", "--window", "16",
                "--kv-tokens", "256", "--threads", "1"], tmp_path)
    base, released, summary = (json.loads(line) for line in out.strip().splitlines()[-3:])
    assert base["keep_every_block"] and not released["keep_every_block"]
    assert summary["same_output"] and released["mean_batch"] > base["mean_batch"]


def test_gpu_check_smoke(tiny_model_dir, tmp_path):
    """bench/gpu_check.py, the GPU acceptance run, dry-run on CPU (`--device cpu`) so it cannot rot between the
    sessions that get a GPU: random weights from a config, engine parity, one cluster, the throughput table."""
    import shutil

    files = tmp_path / "files"
    files.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tiny_model_dir / name).exists():
            shutil.copy(tiny_model_dir / name, files / name)
    config = json.loads((tiny_model_dir / "config.json").read_text())
    config["max_position_embeddings"] = 2048  # the check's prompts reach 1500 tokens
    (files / "config.json").write_text(json.dumps(config))
    out = tmp_path / "gpu_check.json"
    _run(["bench/gpu_check.py", "--model-files", str(files), "--device", "cpu", "--dtypes", "float32",
          "--modes", "tcp", "--batches", "2", "--out", str(out)], tmp_path)
    doc = json.loads(out.read_text())
    assert {k: v["agreement"] for k, v in doc["engine"].items()} == {"float32/auto": 1.0, "float32/torch": 1.0}
    assert doc["cluster"]["tcp"]["agreement"] == 1.0 and doc["cluster"]["tcp"]["idle"]
    (row,) = doc["throughput"]
    assert row["batch"] == 2 and row["hf_tok_s"] > 0 and row["pdserve_graphs_tok_s"] > 0 and row["ratio_eager"] > 0


def test_sweep_names_no_dense_dtype_for_quantized_weights():
    """The machine-fraction baseline is a dense GEMM in the system's dtype; quantized weights have none (int4 at
    M = 1 outruns the dense bf16 GEMM, which read as a fraction above 1). A --variant is pdserve whatever its name
    (one called "int4" used to be taken for a vLLM peer in fp32, and its int4 read 1.25 of the fp32 GEMM rate)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from sweep import dense_dtype, weight_format

    def system_dtype(name, args, pdserve):
        return dense_dtype(weight_format(name, args, pdserve))

    assert system_dtype("pdserve-x", ["--dtype", "bfloat16"], pdserve=True) == "bfloat16"
    assert system_dtype("pdserve-x", ["--dtype", "bfloat16", "--quantization", "int4"], pdserve=True) is None
    assert system_dtype("int4", ["--dtype", "bfloat16", "--quantization", "int4"], pdserve=True) is None
    assert system_dtype("x", ["--quantization", "none", "--dtype", "bfloat16"], pdserve=True) == "bfloat16"
    assert system_dtype("llamacpp", [], pdserve=False) is None and system_dtype("naive", [], False) == "float32"
    assert system_dtype("vllm-all-cores-bf16", [], False) == "bfloat16" and system_dtype("vllm", [], False) == "float32"
    assert system_dtype("my-peer", [], pdserve=False) is None  # a --peer: its dtype is not known
    assert system_dtype("llamacpp-f32", [], False) == "float32"
    assert system_dtype("llamacpp-bf16", [], False) == "bfloat16"
    assert system_dtype("llamacpp-q8_0", [], pdserve=False) is None
    # fp32 on the packaged Q4_1 model: the compute is fp32 (its GEMM rate the baseline), the weights read as blocks
    assert weight_format("p", ["--dtype", "float32"], pdserve=True, gguf_source="q4_1") == "float32+gguf:q4_1"
    assert dense_dtype("float32+gguf:q4_1") == "float32"
    assert weight_format("p", ["--dtype", "bfloat16"], pdserve=True, gguf_source="q4_1") == "bfloat16"
    # --quantization gguf reads the same file's blocks as llama.cpp does (8-bit rows, integer dot products)
    assert weight_format("p", ["--quantization", "gguf"], pdserve=True, gguf_source="q4_1") == "gguf:q4_1"


@pytest.mark.parametrize("auto, peers", [("bfloat16", {"llamacpp-bf16", "vllm-bf16", "vllm-all-cores-bf16"}),
                                         ("float32", {"llamacpp-f32", "vllm", "vllm-all-cores"})])
def test_the_sweep_runs_each_peer_in_this_cpus_best_dense_precision(monkeypatch, auto, peers):
    """A peer's bf16 is emulated on a CPU without AVX512-BF16 or AMX (slower than its fp32): the default systems
    follow what pdserve's --dtype auto picks on the same CPU, beside llama.cpp's Q4_1 and Q8_0 GGUFs on either."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from pdserve_server.engine import hardware
    from sweep import ALL_SYSTEMS, default_systems

    monkeypatch.setattr(hardware, "resolve_dtype", lambda dtype, device: auto)
    chosen = default_systems()
    assert set(chosen) == {"pdserve-disagg", "pdserve-colocated", "naive", *peers, "llamacpp", "llamacpp-q8_0"}
    assert set(chosen) <= set(ALL_SYSTEMS)


def test_sweep_weight_bytes_per_token(tiny_model_dir, real_model_dir):
    """Bytes of matmul weights read per token at batch 1, the numerator of the concurrency-1 bandwidth fraction:
    every projection and the LM head, at each system's storage size; llama.cpp's from the GGUF it runs."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import gguf
    from step_profile import config_linear_shapes
    from sweep import weight_bytes_per_token as bytes_of, weight_format
    from transformers import AutoConfig

    from pdserve_server.cli.models import default_model_path
    from pdserve_server.engine.models.config import ModelConfig
    from pdserve_server.engine.hardware import resolve_dtype

    # tiny model: hidden 64, 4 q / 2 kv heads of 16, intermediate 128, 2 layers, vocab 49152 (untied head)
    layer = 64 * (64 + 2 * 32) + 64 * 64 + 64 * 256 + 128 * 64
    params = 2 * layer + 64 * 49152
    model = str(tiny_model_dir)
    shapes = config_linear_shapes(ModelConfig.from_hf(AutoConfig.from_pretrained(model), name="m", path=model))

    def weight_bytes_per_token(name, args, pdserve):
        return bytes_of(weight_format(name, args, pdserve), shapes)

    # auto is bf16 on a CPU with AVX512_BF16 or AMX, else fp32 (engine.hardware.resolve_dtype): per machine
    auto_bytes = 2 if resolve_dtype("auto", "cpu") == "bfloat16" else 4
    assert weight_bytes_per_token("pdserve-colocated", [], pdserve=True) == auto_bytes * params
    assert weight_bytes_per_token("v", ["--dtype", "float32"], pdserve=True) == 4 * params
    assert weight_bytes_per_token("v", ["--dtype", "bfloat16"], pdserve=True) == 2 * params
    assert weight_bytes_per_token("v", ["--dtype", "bfloat16", "--quantization", "int4"],
                                  pdserve=True) == params * 0.625
    outputs = 2 * (128 + 64 + 256 + 64) + 49152
    assert weight_bytes_per_token("v", ["--dtype", "bfloat16", "--quantization", "int8"],
                                  pdserve=True) == params + 2 * outputs
    assert weight_bytes_per_token("naive", [], pdserve=False) == 4 * params
    assert weight_bytes_per_token("vllm-all-cores-bf16", [], pdserve=False) == 2 * params
    assert weight_bytes_per_token("my-peer", [], pdserve=False) is None
    tensors = gguf.GGUFReader(str(default_model_path())).tensors
    gguf_2d = sum(int(t.n_bytes) for t in tensors if len(t.shape) == 2)
    assert weight_bytes_per_token("llamacpp", [], pdserve=False) == gguf_2d > 90e6  # Q4_1 layers, Q8_0 head
    # pdserve fp32 on the packaged model reads the blocks of that same file (engine.execution.packing.gguf_blocks)
    assert bytes_of(weight_format("p", ["--dtype", "float32"], True, gguf_source="q4_1"), shapes) == gguf_2d


def test_linear_shapes_of_a_mixture_of_experts_count_the_router_and_top_k_experts():
    """bench/step_profile.py's per-token matmul shapes for a Qwen3-MoE whose layer 1 is dense (`mlp_only_layers`):
    the sparse layer has the router and top_k = 2 experts' gate/up and down, not the dense MLP's."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from step_profile import config_linear_shapes
    from transformers import Qwen3MoeConfig

    from pdserve_server.engine.models.config import ModelConfig

    hf = Qwen3MoeConfig(vocab_size=100, hidden_size=16, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=4,
                        num_experts_per_tok=2, moe_intermediate_size=12, mlp_only_layers=[1])
    attn = [(16, 16 + 2 * 8), (16, 16)]
    assert config_linear_shapes(ModelConfig.from_hf(hf, name="m", path="")) == [
        *attn, (16, 4), (16, 24), (12, 16), (16, 24), (12, 16),  # layer 0: router, then 2 experts
        *attn, (16, 96), (48, 16),  # layer 1: dense
        (16, 100)]


def test_sweep_refuses_a_malformed_peer_before_running_anything(tmp_path):
    proc = subprocess.run([sys.executable, "bench/sweep.py", "--systems", "", "--peer", "bogus",
                           "--out-dir", str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "--peer wants name=http://host:port" in proc.stderr
    assert "starting" not in proc.stdout


def test_small_linear_smoke(tiny_model_dir, tmp_path):
    """The small-M linear benchmark on the tiny model's shapes: a row per row count, both sides timed."""
    out = tmp_path / "small_linear.json"
    _run(["bench/small_linear.py", "--model-dir", str(tiny_model_dir), "--rows", "1,5", "--repeats", "1",
          "--threads", "1", "--out", str(out)], tmp_path)
    result = json.loads(out.read_text())
    assert [r["rows"] for r in result["rows"]] == [1, 5]
    assert all(r["ours_ms"] > 0 and r["theirs_ms"] > 0 and r["ratio"] > 0 for r in result["rows"])


def test_small_linear_smoke_with_the_int8_gemm(tiny_model_dir, tmp_path):
    """`--kernel int8`: the int8 GEMM of --quantization w8a8_int8 on the shapes it takes (layers, LM head), timed;
    with `--ceiling`, where the library runs a vector build, each row also against the CPU's ceiling for that build's
    instruction mix (bench/int8_ceiling.c, built with the system's compiler), probed around it."""
    from pdserve_server.kernels.cpu_ops import cpu_isa, load_library

    load_library()
    vector = cpu_isa() != "base"
    out = tmp_path / "int8_linear.json"
    _run(["bench/small_linear.py", "--model-dir", str(tiny_model_dir), "--kernel", "int8", "--rows", "65,130",
          "--repeats", "1", "--threads", "1", "--out", str(out)] + (["--ceiling"] if vector else []), tmp_path)
    result = json.loads(out.read_text())
    assert result["kernel"] == "int8" and [r["rows"] for r in result["rows"]] == [65, 130]
    assert all(r["ours_ms"] > 0 and r["theirs_ms"] > 0 and r["ratio"] > 0 for r in result["rows"])
    if vector:
        assert result["ceiling_mix"] in ("avx2", "avx512", "avx512_vnni")
        for r in result["rows"]:
            assert r["ceiling_gops"] == max(r["ceiling_probes"]) > 0 and len(r["ceiling_probes"]) == 2
            assert r["of_ceiling"] == r["ours_gflops"] / r["ceiling_gops"]


def test_small_linear_ceiling_asks_for_the_int8_kernel():
    """`--ceiling` without `--kernel int8` is a one-line usage error before anything is built or timed."""
    proc = subprocess.run([sys.executable, "bench/small_linear.py", "--ceiling"], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 2 and "--ceiling measures the int8 GEMM's ceiling: add --kernel int8" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_small_linear_smoke_int8_against_the_gguf_blocks(tiny_model_dir, tmp_path):
    """`--baseline blocks`: decode-sized rows of the int8 GEMM against the Q4_1 blocks a decode step reads otherwise
    (the weights made exactly Q4_1: the blocks kernel refuses anything else)."""
    out = tmp_path / "int8_blocks.json"
    _run(["bench/small_linear.py", "--model-dir", str(tiny_model_dir), "--kernel", "int8", "--baseline", "blocks",
          "--rows", "1,3", "--repeats", "1", "--threads", "1", "--out", str(out)], tmp_path)
    result = json.loads(out.read_text())
    assert result["baseline"] == "blocks" and [r["rows"] for r in result["rows"]] == [1, 3]
    assert all(r["ours_ms"] > 0 and r["theirs_ms"] > 0 and r["ratio"] > 0 for r in result["rows"])


def test_step_profile_smoke_where_prefill_outlasts_short_requests(tiny_model_dir, tmp_path):
    """bench/step_profile.py's timed decode steps at a batch whose prefill takes more engine steps (64 x 256 tokens:
    32 at 512 a step) than its requests' few timed tokens: every request still decodes in the timed steps (it once
    ran them out first, then an empty step)."""
    out = tmp_path / "step_profile.json"
    _run(["bench/step_profile.py", "--model-dir", str(tiny_model_dir), "--dtypes", "float32", "--backends", "cpu",
          "--batches", "64", "--context", "256", "--steps", "1", "--threads", "1", "--out", str(out)], tmp_path)
    point, = json.loads(out.read_text())["points"]
    assert point["batch"] == 64 and point["step_ms"] > 0 and point["tok_s"] > 0
