"""Errors the person running a command can act on: reported as one line and a non-zero exit, never a traceback."""
from __future__ import annotations


class CommandError(RuntimeError):
    """A command cannot start, go on serving or finish for a reason its user can fix: a port in use, a missing
    model, a worker that never became ready, an engine fault that needs a restart, a request the server refused.
    `cli.main` prints the message alone and exits 1. A RuntimeError, so callers that caught the launcher's
    RuntimeError still do."""
