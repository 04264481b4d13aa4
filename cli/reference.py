"""The configuration reference, docs/configuration.md: every command's flags, defaults and choices as `--help`
prints them, generated from the parsers (themselves built from the config dataclasses), so it cannot drift from the
code (tests/cli/test_cli.py compares the file with this output).

    .venv/bin/python -m pdserve_server.cli.reference > docs/configuration.md
"""
from __future__ import annotations

import os
import sys

WIDTH = 110  # fixed, so the file does not depend on the terminal that regenerated it


def configuration_reference() -> str:
    """docs/configuration.md's text: a heading and the `--help` of each command of `cli.main.COMMANDS`, in order,
    with the defaults an environment without `PDSERVE_*` variables gives (some flags default to one: $PDSERVE_MODEL,
    $PDSERVE_ADDRESS, $PDSERVE_API_KEY); the environment is restored after."""
    from pdserve_server.cli.main import COMMANDS, build_parser

    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("PDSERVE_")}
    try:
        return _reference(COMMANDS, build_parser)
    finally:
        os.environ.update(saved)


def _reference(commands, build_parser) -> str:
    parts = ["# Configuration reference\n",
             "Every flag of every `pdserve` command, with its default and choices, as `pdserve COMMAND --help`\n"
             "prints it. Generated from the configuration dataclasses (`engine/args.py`, `worker_common/config.py`,\n"
             "`coordinator/config.py`, `server_common/config.py`, `cli/launcher.py`) by\n"
             "`python -m pdserve_server.cli.reference > docs/configuration.md` under Python "
             f"{python_version()} (argparse's layout\nvaries between versions); a test fails when this file is not "
             "current.\n"]
    for name in commands:
        parser = build_parser(name)
        formatter = parser.formatter_class
        parser.formatter_class = lambda prog, cls=formatter: cls(prog, width=WIDTH)
        parts.append(f"## pdserve {name}\n\n```text\n{parser.format_help().rstrip()}\n```\n")
    return "\n".join(parts)


def python_version() -> str:
    """'3.11': the Python whose argparse laid the reference out."""
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def main() -> None:
    print(configuration_reference(), end="")


if __name__ == "__main__":
    main()
