"""The compiled cpu kernels (`kernels/_C`, built by setup.py at install time) as a worker loads them: every ISA level
is built and the best one the CPU runs is chosen, `$PDSERVE_CPU_ISA` overrides it, the ops are torch custom ops with
fake implementations, a missing or broken build fails the cpu backend with a message that says what to do, and a
worker serves on them with no compiler anywhere on its PATH."""
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdserve_server.engine.hardware import cpu_flags
from pdserve_server.kernels import cpu_ops
from pdserve_server.kernels.backends import select_ops
from pdserve_server.kernels.cpu_ops import ALL_ISAS, CpuKernels, KernelLoadError, cpu_isa, cpu_isas, set_cpu_isa

# What each level's build was compiled for (setup.py ISA_LEVELS), as /proc/cpuinfo names the flags.
ISA_FLAGS = {"base": set(), "avx2": {"avx2", "fma"},
             "avx512": {"avx2", "fma", "avx512f", "avx512bw", "avx512dq", "avx512vl"},
             "avx512_vnni": {"avx2", "fma", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni"},
             "avx512_bf16": {"avx2", "fma", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni",
                             "avx512_bf16"}}


@pytest.fixture
def restore_isa():
    """Whatever a test switches, the next one runs the build it found."""
    CpuKernels.load()
    before = cpu_isa()
    yield
    torch.ops.pdserve.set_cpu_isa(before)  # the op itself: the test may have left the loader's state patched


def test_every_isa_level_is_built_and_the_cpu_picks_among_them(restore_isa):
    """Each level links into the library, also those this CPU cannot run (they must compile wherever the package
    is built); the levels offered are exactly those whose instructions /proc/cpuinfo lists, best first."""
    runnable = [isa for isa in ALL_ISAS if ISA_FLAGS[isa] <= cpu_flags()] if Path("/proc/cpuinfo").exists() \
        else cpu_isas()
    assert cpu_isas() == runnable and runnable[-1] == "base"
    for isa in ALL_ISAS:
        if isa in runnable:
            set_cpu_isa(isa)
            assert cpu_isa() == isa
        else:
            with pytest.raises(ValueError, match=f"this CPU lacks the instructions of the {isa} build"):
                set_cpu_isa(isa)
    with pytest.raises(ValueError, match="no sse9 build of the cpu kernels; built: " + " ".join(ALL_ISAS)):
        set_cpu_isa("sse9")


def test_the_environment_picks_the_build(monkeypatch, restore_isa):
    """$PDSERVE_CPU_ISA, read when the library loads (here loaded again by hand: the process has it already), names
    the build to run; one the library lacks fails the cpu backend."""
    monkeypatch.setattr(cpu_ops, "_loaded", False)
    monkeypatch.setenv(cpu_ops.ISA_ENV, "base")
    cpu_ops.load_library()
    assert cpu_isa() == "base"
    monkeypatch.setattr(cpu_ops, "_loaded", False)
    monkeypatch.setenv(cpu_ops.ISA_ENV, "sse9")
    with pytest.raises(KernelLoadError, match=r"\$PDSERVE_CPU_ISA=sse9: no sse9 build"):
        cpu_ops.load_library()
    with pytest.raises(ValueError, match="attention backend 'cpu': .*PDSERVE_CPU_ISA=sse9"):
        select_ops("auto", "cpu")


def test_a_fresh_process_runs_the_best_build(tmp_path):
    """Without $PDSERVE_CPU_ISA, the library's own choice: the first (best) build this CPU runs."""
    env = {k: v for k, v in os.environ.items() if k != cpu_ops.ISA_ENV}
    out = subprocess.run([sys.executable, "-c", "from pdserve_server.kernels.cpu_ops import cpu_isa, cpu_isas; "
                          "print(cpu_isa(), cpu_isas()[0])"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    chosen, best = out.stdout.split()
    assert chosen == best


@pytest.mark.parametrize("broken", ["missing", "load fails", "other torch", "older sources"])
def test_a_missing_or_broken_build_fails_the_cpu_backend_with_a_clear_error(monkeypatch, broken):
    """No silent fallback to the slower reference: "auto" on CPU and "cpu" both refuse, naming the cause and the
    fixes; "torch", chosen explicitly, still works."""
    monkeypatch.setattr(cpu_ops, "_loaded", False)
    if broken == "missing":
        find_spec = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *a: None if name == "pdserve_server.kernels._C" else find_spec(name, *a))
        cause = r"the compiled cpu kernels \(kernels/_C\) are not installed"
    elif broken == "load fails":
        def load_library(path):
            raise OSError(f"{path}: undefined symbol: _ZN3c104impl")
        monkeypatch.setattr(torch.ops, "load_library", load_library)
        cause = r"the compiled cpu kernels .*_C.* failed to load \(.*undefined symbol"
    elif broken == "older sources":  # an editable install whose library predates an op: registering its fake fails
        def register_fakes():
            raise RuntimeError("operator pdserve::linear_small_m does not exist")
        monkeypatch.setattr(cpu_ops, "_fakes_registered", False)
        monkeypatch.setattr(cpu_ops, "_register_fakes", register_fakes)
        cause = r"the compiled cpu kernels .*_C.* lack an op this pdserve calls \(operator pdserve::linear_small_m"
    else:
        monkeypatch.setattr(torch, "__version__", "2.0.0")
        cause = r"the compiled cpu kernels .*_C.* were built against torch " + re.escape(
            f"{torch.ops.pdserve.torch_version()} but torch 2.0.0 is running")
    for backend in ("auto", "cpu"):
        with pytest.raises(ValueError, match=f"attention backend 'cpu': {cause}") as e:
            select_ops(backend, "cpu")
        assert "scripts/install.sh" in str(e.value) and "--attention-backend torch" in str(e.value)
    assert select_ops("torch", "cpu").name == "torch"
    with pytest.raises(ValueError, match="CPU only"):
        select_ops("cpu", "meta")


def test_the_ops_are_torch_custom_ops_with_fake_implementations():
    """torch.library.opcheck: schemas (which arguments each op mutates), fake implementations against the real
    ones, and tracing; bf16, the dtype a worker runs where the CPU computes it well."""
    CpuKernels.load()
    ops, bf16 = torch.ops.pdserve, torch.bfloat16
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(8, 2, 16, 3, 64, generator=g).to(bf16)
    k_cache, v_cache = kv[:, 0], kv[:, 1]  # per-layer views, strided in dim 0
    query = torch.randn(2, 15, 64, generator=g).to(bf16)[:, :9]  # the q heads of fused q/k/v rows
    tables, lens = torch.tensor([[5, 0], [1, 2]], dtype=torch.int32), torch.tensor([16, 20], dtype=torch.int32)
    x, weight = torch.randn(3, 64, generator=g).to(bf16), torch.randn(64, generator=g).to(bf16)
    qkv, cos, sin = (torch.randn(2, 15, 64, generator=g).to(bf16) for _ in range(3))
    cases = [(ops.paged_decode_attention.default, (query, k_cache, v_cache, tables, lens, 0.125)),
             (ops.paged_decode_attention.default, (query, k_cache, v_cache, tables, lens, 0.125, 5)),  # a window
             (ops.rms_norm.default, (x, weight, 1e-5, torch.randn(3, 64, generator=g).to(bf16))),
             (ops.silu_and_mul.default, (torch.randn(3, 64, generator=g).to(bf16),)),
             (ops.rotary_and_write_kv.default, (qkv, cos[:, 0], sin[:, 0], k_cache, v_cache, torch.tensor([3, 17]))),
             (ops.causal_softmax_.default, (torch.randn(2, 4, 10, generator=g).to(bf16), 4, 0.5)),
             (ops.linear_small_m.default, (torch.randn(3, 64, generator=g), torch.randn(5, 64, generator=g),
                                           torch.randn(5, generator=g)))]  # fp32: the op's one dtype
    for op, args in cases:
        assert all(v == "SUCCESS" for v in torch.library.opcheck(op, args).values()), op
    with torch.device("meta"):  # the fakes give shapes without running C
        assert ops.silu_and_mul(torch.empty(5, 8)).shape == (5, 4)


def test_the_ops_check_what_the_c_code_relies_on():
    """Called directly (not through CpuKernels, which takes the reference for what C does not compute), each op
    refuses input the kernel would read out of bounds or misread, as a ValueError."""
    CpuKernels.load()
    ops = torch.ops.pdserve
    kv = torch.zeros(4, 2, 8, 1, 16)
    k_cache, v_cache = kv[:, 0], kv[:, 1]
    tables, lens = torch.zeros(2, 2, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="up to 16 query heads per kv head"):
        ops.paged_decode_attention(torch.zeros(2, 17, 16), k_cache, v_cache, tables, lens, 1.0)
    with pytest.raises(ValueError, match="float32 or bfloat16, got Half"):
        ops.paged_decode_attention(torch.zeros(2, 4, 16).half(), k_cache, v_cache, tables, lens, 1.0)
    with pytest.raises(ValueError, match="k_cache must be dense within a block"):
        ops.paged_decode_attention(torch.zeros(2, 4, 16), k_cache.transpose(1, 2), v_cache.transpose(1, 2), tables,
                                   lens, 1.0)
    with pytest.raises(ValueError, match="block_tables must be .* int32"):
        ops.paged_decode_attention(torch.zeros(2, 4, 16), k_cache, v_cache, tables.long(), lens, 1.0)
    with pytest.raises(ValueError, match=r"sliding_window must be in \[0, 2\^31\) \(0: no window\), got -1"):
        ops.paged_decode_attention(torch.zeros(2, 4, 16), k_cache, v_cache, tables, lens, 1.0, -1)
    with pytest.raises(ValueError, match="weight must be"):
        ops.rms_norm(torch.zeros(3, 64), torch.ones(32), 1e-5)
    with pytest.raises(ValueError, match="residual must be contiguous"):
        ops.rms_norm(torch.zeros(3, 64), torch.ones(64), 1e-5, torch.zeros(64, 3).t())
    with pytest.raises(ValueError, match="gate_up must be"):
        ops.silu_and_mul(torch.zeros(3, 7))
    with pytest.raises(ValueError, match="qkv's heads must be dense"):
        ops.rotary_and_write_kv(torch.zeros(2, 16, 3).transpose(1, 2), torch.zeros(2, 16), torch.zeros(2, 16),
                                k_cache, v_cache, torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="slot_mapping must be .* int64"):
        ops.rotary_and_write_kv(torch.zeros(2, 3, 16), torch.zeros(2, 16), torch.zeros(2, 16), k_cache, v_cache,
                                torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="scores must be contiguous bfloat16"):
        ops.causal_softmax_(torch.zeros(4, 4), 4, 1.0)


# Run by a worker's own code path (build_engine -> ModelRunner -> select_ops("auto")) in a process whose PATH has
# nothing but a python, and no $CC: the kernels must come from the install, not from a compiler.
_SERVE_WITHOUT_COMPILER = """
import json, shutil, sys
assert not any(shutil.which(c) for c in ("cc", "gcc", "c++", "g++", "clang")), "a compiler is on PATH"
from pdserve_server.engine.args import EngineArgs
from pdserve_server.engine.builder import build_engine
from pdserve_server.engine.offline import run_until_idle
from pdserve_server.engine.request import Request, SamplingParams
from pdserve_server.kernels.cpu_ops import cpu_isa, cpu_isas
parts = build_engine(EngineArgs(dtype="float32", model_dir=sys.argv[1], block_size=8, kv_tokens=512,
                                max_model_len=256))
req = Request("r", list(range(3, 40)), SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
              eos_token_ids=(2,))
run_until_idle(parts, [req])
print(json.dumps({"backend": parts.runner.attention_ops.name, "isa": cpu_isa(), "best": cpu_isas()[0],
                  "tokens": req.output_token_ids}))
"""


def test_a_worker_serves_on_the_compiled_kernels_with_no_compiler_on_path(tmp_path, tiny_model_dir):
    from pdserve_server.engine.args import EngineArgs
    from pdserve_server.engine.builder import build_engine
    from pdserve_server.engine.offline import run_until_idle
    from pdserve_server.engine.request import Request, SamplingParams

    bare = tmp_path / "bin"
    bare.mkdir()
    (bare / "python").symlink_to(sys.executable)
    env = {k: v for k, v in os.environ.items() if k not in ("CC", "CXX", cpu_ops.ISA_ENV)} | {"PATH": str(bare)}
    out = subprocess.run([sys.executable, "-c", _SERVE_WITHOUT_COMPILER, str(tiny_model_dir)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    served = json.loads(out.stdout.strip().splitlines()[-1])
    assert served["backend"] == "cpu" and served["isa"] == served["best"]  # the C kernels, best build: full speed
    # and the same tokens as the torch reference (greedy, fp32)
    parts = build_engine(EngineArgs(dtype="float32", model_dir=str(tiny_model_dir), block_size=8, kv_tokens=512,
                                    max_model_len=256, attention_backend="torch"))
    req = Request("r", list(range(3, 40)), SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                  eos_token_ids=(2,))
    run_until_idle(parts, [req])
    assert served["tokens"] == req.output_token_ids



def test_loading_the_library_changes_nothing_else_in_the_process():
    """-ffast-math at link time would add crtfastmath.o, whose constructor turns on flush-to-zero for the whole
    process (torch's numerics included) when the library loads: subnormals must survive. And its OpenMP calls
    bind to the libgomp torch loaded: a second OpenMP runtime would keep its own thread pool beside torch's."""
    CpuKernels.load()
    assert (torch.tensor([1e-38]) * torch.tensor([1e-3])).item() != 0.0
    maps = Path("/proc/self/maps")
    if maps.exists():
        gomp = {line.split()[-1] for line in maps.read_text().splitlines() if "libgomp" in line}
        assert len(gomp) <= 1, gomp
