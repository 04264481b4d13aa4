"""The compiled part of pdserve: the cpu backend's kernels as one torch extension, kernels/_C, built at install time.

The C kernels (kernels/cpu_decode.c, kernels/cpu_layer_ops.c, kernels/cpu_linear.c, kernels/cpu_decode_step.c,
kernels/cpu_prefill_attention.c, kernels/cpu_int8_gemm.c) are compiled once per ISA level below, each with its own -m
flags and its level's name in its symbols (kernels/cpu_kernels.h), and linked with the torch ops of
kernels/cpu_ops.cpp, which pick one level at run time from the CPU's features. No -march=native: the library is
built once (a wheel, a Docker build stage) and runs on whatever x86 CPU serves, so each level targets an ISA, and the
run-time choice keeps AVX-512
(and AVX512_BF16's VDPBF16PS) where the CPU has it.

torch is a build dependency with an ABI: the extension must be built against the torch it runs with. Install torch
first, then pdserve with `pip install --no-build-isolation` (scripts/install.sh, deploy/Dockerfile); an isolated
build would compile against whatever torch pip fetched for it. kernels/cpu_ops.py refuses to load a library built
against another torch version.
"""
import os
import platform
import shlex
import sysconfig
import warnings

from setuptools import find_packages, setup

# A fresh install builds before it installs numpy, which torch's import then warns about (harmless here).
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
try:
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError as e:  # pragma: no cover - the message is the point
    raise SystemExit("pdserve's CPU kernels are built against the installed torch: install torch first, then "
                     "pdserve with `pip install --no-build-isolation` (see scripts/install.sh)") from e

C_SOURCES = ["kernels/cpu_decode.c", "kernels/cpu_layer_ops.c", "kernels/cpu_linear.c",
             "kernels/cpu_decode_step.c", "kernels/cpu_prefill_attention.c", "kernels/cpu_int8_gemm.c"]
HEADERS = ["kernels/cpu_bf16.h", "kernels/cpu_kernels.h"]
# -ffast-math is for compiling only: linked with it, GCC < 13 adds crtfastmath.o, whose constructor turns on
# flush-to-zero for the whole process (torch's numerics included) when the library loads. It lets the compiler
# reassociate the kernels' dot products and call glibc's vector expf (libmvec), 2x on the decode kernel.
C_FLAGS = ["-O3", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11", "-Wall"]
X86 = platform.machine().lower() in ("x86_64", "amd64")
_AVX2 = ["-mavx2", "-mfma", "-mf16c"]
# -mprefer-vector-width=512: GCC otherwise keeps to 256-bit vectors on AVX-512 CPUs (one run, 64 sequences x 272
# tokens, fp32: 8.2 ms per layer at 256 bits, 4.1 at 512).
_AVX512 = _AVX2 + ["-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mprefer-vector-width=512"]
# Level -> its -m flags; kernels/cpu_ops.cpp checks the same features before it runs a level. base, for any CPU:
# plain x86-64 (SSE2) named explicitly on x86, since a compiler may default to a later level (x86-64-v3 has AVX2,
# which any CPU would then be run), the compiler's default target elsewhere. avx512_vnni adds VPDPBUSD (the int8
# GEMM's block products; Cascade Lake, Ice Lake), avx512_bf16 VDPBF16PS on top (every CPU with it has VNNI: Cooper
# Lake, Sapphire Rapids, Zen 4 and 5). AMX CPUs run avx512_bf16 (the hot loops use no tiles).
ISA_LEVELS = ({"base": ["-march=x86-64", "-mtune=generic"], "avx2": _AVX2, "avx512": _AVX512,
               "avx512_vnni": _AVX512 + ["-mavx512vnni"], "avx512_bf16": _AVX512 + ["-mavx512vnni", "-mavx512bf16"]}
              if X86 else {"base": []})


class BuildKernels(BuildExtension):
    """torch's BuildExtension (the C++ ops against torch's headers and libraries), with each ISA level's objects of
    the C sources compiled first and linked in."""

    def build_extension(self, ext):
        # Compiled here, not by BuildExtension's compiler: that one compiles every source as C++ (with ninja) and
        # adds C++ flags, and Python's CFLAGS (-fwrapv, -g) are not for these loops. $CC as setuptools reads it.
        cc = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")
        objects = []
        for isa, flags in ISA_LEVELS.items():
            out_dir = os.path.join(self.build_temp, "kernels", isa)
            self.mkpath(out_dir)
            for src in C_SOURCES:
                obj = os.path.join(out_dir, os.path.basename(src).removesuffix(".c") + ".o")
                self.spawn([*cc, *C_FLAGS, *flags, f"-DPDSERVE_ISA={isa}", "-Ikernels", "-c", src, "-o", obj])
                objects.append(obj)
        ext.extra_objects = objects
        super().build_extension(ext)


# Everything the servers install lives under one namespace, pdserve_server (the SDK is `pdserve`): generic top-level
# names (`cli`, `engine`, and `kernels`, also Hugging Face's package that transformers probes) would shadow or be
# shadowed by other distributions. The folders stay at the repository's top level (the product card's layout); each
# is mapped to its place in the namespace, which has no __init__.py of its own (an implicit namespace package).
SERVER_PACKAGES = ["cli", "server_common", "coordinator", "worker_common", "prefill_worker", "decode_worker", "engine",
                   "kernels", "kv_transfer"]
# kernels/ has no __init__.py (its backend choice is kernels/backends.py): a process started in the repository's root
# (`python -m pytest`, `python -m pdserve_server...`) has that root on sys.path, and a regular package named kernels
# there would shadow Hugging Face's, which transformers (>= 5) imports; a namespace portion never shadows a regular
# package, wherever it sits on sys.path.
NAMESPACE_PACKAGES = ["kernels"]

setup(
    package_dir={f"pdserve_server.{top}": top for top in SERVER_PACKAGES},
    packages=[f"pdserve_server.{p}" for p in find_packages(include=[f"{top}*" for top in SERVER_PACKAGES])
              + NAMESPACE_PACKAGES],
    ext_modules=[CppExtension(
        "pdserve_server.kernels._C", ["kernels/cpu_ops.cpp"], include_dirs=["kernels"], depends=C_SOURCES + HEADERS,
        define_macros=[("PDSERVE_TORCH_VERSION", torch.__version__)] + ([("PDSERVE_X86_LEVELS", None)] if X86 else []),
        # -g0 over Python's -g (a 4 MB library, mostly debug info); -fopenmp and libm (libmvec) for the C objects.
        extra_compile_args=["-O2", "-g0"], extra_link_args=["-fopenmp"], libraries=["m"],
        # The library has no Python code (ops only; cpu_ops.py loads it with torch.ops.load_library): one build
        # serves every CPython.
        py_limited_api=True)],
    cmdclass={"build_ext": BuildKernels},
)
