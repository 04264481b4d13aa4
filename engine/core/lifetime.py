"""Child processes that cannot outlive their parent: the engine process (child of its worker) and its
tensor-parallel ranks (children of the engine process)."""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from typing import NoReturn

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies (kill -9 of the worker leaves no engine behind, kill -9 of
    an engine process no rank). Elsewhere a warning: an orphan may outlive its parent."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
            return
        except OSError:
            pass
    log.warning("could not ask to die with the parent process (prctl); an orphaned child may outlive it")


def exit_now(code: int = 0) -> NoReturn:
    """End a server process that has shut down cleanly without the interpreter's teardown: flush the logs and the
    standard streams, then `os._exit(code)`. With torch loaded that teardown takes about half a second (this
    machine: `python -c "import torch"` 1.52-1.55 s, 1.01-1.08 s ending in os._exit), paid at every stop and
    restart of a worker and of its engine process, and it does nothing these processes need: their servers,
    sockets and child processes are closed or joined by then, span exporters flushed (`Tracing.shutdown`), and the
    KV pool is torch shared memory passed by file descriptor (nothing to unlink)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or gone: nothing left to lose
            pass
    os._exit(code)
