"""Errors a process's operator can act on: reported as one line and a non-zero exit, never as a traceback."""
from __future__ import annotations


class StartupError(RuntimeError):
    """A process cannot start or keep serving for a reason its operator can fix (a port in use, a worker that
    never became ready, an engine fault that needs a restart). `cli.main` prints the message alone and exits 1.
    A RuntimeError, so callers that caught the launcher's RuntimeError still do."""
