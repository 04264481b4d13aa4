"""Process-wide logging set-up, shared by every command and by a worker's engine process."""
from __future__ import annotations

import logging


def configure_logging(level: str, fmt: str) -> None:
    """Root logging for the process: readable text, or JSON lines for log shippers (python-json-logger).

    Args:
        level: a logging level name ("info", "DEBUG", ...).
        fmt: "text" or "json".
    """
    from pdserve_server.server_common.tracing import TraceContextFilter, TraceFormatter

    handler = logging.StreamHandler()
    handler.addFilter(TraceContextFilter())  # lines logged inside a traced request name its trace
    if fmt == "json":
        from pythonjsonlogger.json import JsonFormatter

        handler.setFormatter(JsonFormatter("%(asctime)s %(levelname)s %(name)s %(process)d %(message)s",
                                           rename_fields={"levelname": "level", "asctime": "time"}))
    else:
        handler.setFormatter(TraceFormatter("%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler])
