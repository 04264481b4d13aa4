"""The `kernels` fixture the C kernels' tests share (imported by name: a conftest.py here would shadow tests/conftest.py
for the modules that `from conftest import` its helpers)."""
import pytest

from pdserve_server.kernels.cpu_ops import ALL_ISAS, CpuKernels, cpu_isa, cpu_isas, set_cpu_isa


@pytest.fixture(scope="module", params=ALL_ISAS)
def kernels(request):
    """The ops, running the param's build: cpu_decode.c's AVX-512 intrinsics path (with VDPBF16PS in avx512_bf16) or
    its AVX2 one (avx2) for head_dim 64 and 128, else the plain loops vectorized for the build's ISA (base: the
    compiler's baseline)."""
    k = CpuKernels.load()
    if request.param not in cpu_isas():
        pytest.skip(f"this CPU cannot run the {request.param} build of the kernels (only {cpu_isas()})")
    default = cpu_isa()
    set_cpu_isa(request.param)
    yield k
    set_cpu_isa(default)
