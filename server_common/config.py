"""The bind settings every server process shares (one definition; the CLI builds its flags from it)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ServerArgs:
    """Where a process serves gRPC.

    Attributes:
        host: bind address.
        port: gRPC port; 0 picks a free one (read it back from the ready file).
        ready_file: where to write {"address": ...} once serving (for launchers and tests); None = don't.
    """

    host: str = field(default="127.0.0.1", metadata={"help": "bind address"})
    port: int = field(default=0, metadata={"help": "gRPC port (0 = any free port; see --ready-file)"})
    ready_file: str | None = field(default=None, metadata={"help": 'write {"address": ...} here once serving'})
