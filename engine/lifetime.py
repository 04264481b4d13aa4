"""Child processes that cannot outlive their parent: the engine process (child of its worker) and its
tensor-parallel ranks (children of the engine process)."""
from __future__ import annotations

import ctypes
import logging
import signal
import sys

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
