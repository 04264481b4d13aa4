"""Build hook: generate the gRPC stubs (with .pyi) from proto/ at build and install time.

The stubs are never committed (see .gitignore); `pip install .` and `pip install -e .` both run this.
"""
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).parent.resolve()


def generate_stubs() -> None:
    """Run grpc_tools.protoc over proto/**/*.proto, writing pdserve/v1/*_pb2*.py(i) into the source tree.

    Raises:
        RuntimeError: protoc reported an error.
    """
    from grpc_tools import protoc  # build-time requirement (pyproject [build-system])
    import grpc_tools

    protos = sorted(str(p.relative_to(ROOT / "proto")) for p in (ROOT / "proto").rglob("*.proto"))
    include = str(Path(grpc_tools.__file__).parent / "_proto")
    args = ["protoc", f"-I{ROOT / 'proto'}", f"-I{include}", f"--python_out={ROOT}", f"--pyi_out={ROOT}",
            f"--grpc_python_out={ROOT}", *protos]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")


class BuildPyWithStubs(build_py):
    """build_py that generates the stubs first, so they are packaged like any other module."""

    def run(self) -> None:
        generate_stubs()
        super().run()


setup(cmdclass={"build_py": BuildPyWithStubs})
