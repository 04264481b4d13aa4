"""Build hook: generate the gRPC stubs (with .pyi) from ../proto into pdserve/v1/ at build and install time.

The stubs are never committed (see .gitignore); `pip install ./sdk` and `pip install -e ./sdk` both run this.
pip builds a local directory in place, so the repository's `proto/` folder beside `sdk/` is reachable.
"""
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).parent.resolve()
PROTO = HERE.parent / "proto"


def generate_stubs() -> None:
    """Run grpc_tools.protoc over proto/**/*.proto, writing pdserve/v1/*_pb2*.py(i) next to this file.

    Raises:
        FileNotFoundError: ../proto is missing (the SDK builds from a checkout of the repository).
        RuntimeError: protoc reported an error.
    """
    from grpc_tools import protoc  # build-time requirement (pyproject [build-system])
    import grpc_tools

    if not PROTO.is_dir():
        raise FileNotFoundError(f"{PROTO} not found: build the SDK from a checkout of the pdserve repository")
    protos = sorted(str(p.relative_to(PROTO)) for p in PROTO.rglob("*.proto"))
    include = str(Path(grpc_tools.__file__).parent / "_proto")
    args = ["protoc", f"-I{PROTO}", f"-I{include}", f"--python_out={HERE}", f"--pyi_out={HERE}",
            f"--grpc_python_out={HERE}", *protos]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")


class BuildPyWithStubs(build_py):
    """build_py that generates the stubs first, so they are packaged like any other module."""

    def run(self) -> None:
        generate_stubs()
        super().run()


setup(cmdclass={"build_py": BuildPyWithStubs})
