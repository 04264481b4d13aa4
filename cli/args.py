"""Command-line flags built from the config dataclasses, so that every default and help text lives in one place.

`add_dataclass_args` turns each field into a flag (`max_num_seqs` -> `--max-num-seqs`; nested dataclasses are
flattened), `dataclass_from_args` builds the config back from the parsed namespace, and `dataclass_to_argv` turns a
config into the flags that reproduce it, which is how `pdserve serve` hands its settings to the processes it
starts. Adding a field to a config dataclass therefore adds the flag to every command that uses it, and `serve`
forwards it, with no other edit. The same approach as vLLM's dataclass-derived engine arguments.

Field metadata understood: "help" (text), "choices" (allowed values), "min" / "gt" (a number's inclusive /
exclusive lower bound, "max" its inclusive upper bound: checked as the flag is parsed, so `--max-num-seqs -1` is
one line of usage error instead of a server that starts and hangs), "cli": False (not a flag; the command supplies
the value).
"""
from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _fields(cls: type) -> list[tuple[dataclasses.Field, Any]]:
    """(field, resolved annotation) pairs of a dataclass; string annotations resolved."""
    hints = typing.get_type_hints(cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls)]


def _scalar_type(annotation: Any) -> tuple[type, bool]:
    """(element type, optional) of `X` or `X | None`."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        return inner, True
    return annotation, False


def _is_cli(f: dataclasses.Field, skip: frozenset[str]) -> bool:
    return f.metadata.get("cli", True) and f.name not in skip


def add_dataclass_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type,
                       skip: frozenset[str] = frozenset()) -> None:
    """Add one flag per field of dataclass `cls` (recursing into dataclass-typed fields).

    Types: int, float, str, `X | None`, bool (`--flag/--no-flag`), `tuple[str, ...]` (repeat the flag). A nested
    dataclass's flags take that class's own defaults. Use `argparse.ArgumentDefaultsHelpFormatter` to show them.

    Raises:
        TypeError: a field type this module cannot express as a flag.
        argparse.ArgumentError: two fields would share a flag.
    """
    for f, annotation in _fields(cls):
        if not _is_cli(f, skip):
            continue
        if dataclasses.is_dataclass(annotation):
            add_dataclass_args(parser, annotation, skip)
            continue
        kind, _ = _scalar_type(annotation)
        kwargs: dict[str, Any] = {"dest": f.name, "help": f.metadata.get("help")}
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        default = None if required else (f.default if f.default is not dataclasses.MISSING else f.default_factory())
        if kind is bool:
            kwargs.update(action=argparse.BooleanOptionalAction, default=default)
        elif typing.get_origin(kind) is tuple:
            kwargs.update(action="append", type=typing.get_args(kind)[0], default=None)
            kwargs["help"] = f"{kwargs['help']} (repeat for more)"
        elif kind in (int, float, str):
            kwargs.update(type=bounded_type(kind, f.metadata), default=default, choices=f.metadata.get("choices"))
            if required:
                kwargs["required"] = True
        else:
            raise TypeError(f"{cls.__name__}.{f.name}: no flag for type {annotation!r}")
        parser.add_argument(_flag(f.name), **kwargs)


def bounded_type(kind: type, metadata) -> Any:
    """The flag's type conversion, checking the field's "min" / "gt" / "max" bounds (argparse reports a failure
    as "argument --flag: ..." and exits 2)."""
    low, above, high = metadata.get("min"), metadata.get("gt"), metadata.get("max")
    if kind is str or (low is None and above is None and high is None):
        return kind

    def convert(text: str):
        value = kind(text)  # ValueError: argparse says "invalid int value"
        if low is not None and value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {text}")
        if above is not None and not value > above:
            raise argparse.ArgumentTypeError(f"must be > {above}, got {text}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"must be <= {high}, got {text}")
        return value
    convert.__name__ = kind.__name__  # argparse names the type in its "invalid ... value" message
    return convert


def dataclass_from_args(cls: type[T], ns: argparse.Namespace, **values: Any) -> T:
    """Build `cls` from parsed flags; `values` supplies fields that are not flags (or overrides them), by name,
    at any nesting depth."""
    kwargs: dict[str, Any] = {}
    for f, annotation in _fields(cls):
        if f.name in values:
            kwargs[f.name] = values[f.name]
        elif dataclasses.is_dataclass(annotation):
            kwargs[f.name] = dataclass_from_args(annotation, ns, **values)
        elif hasattr(ns, f.name) and f.metadata.get("cli", True):  # a non-flag field comes from `values` only
            value = getattr(ns, f.name)
            kwargs[f.name] = tuple(value or ()) if typing.get_origin(_scalar_type(annotation)[0]) is tuple else value
    return cls(**kwargs)


def dataclass_to_argv(obj: Any, skip: frozenset[str] = frozenset()) -> list[str]:
    """The flags that rebuild `obj` through `add_dataclass_args` + `dataclass_from_args`: one per field whose value
    differs from its default (nested dataclasses flattened; fields in `skip` or marked "cli": False left out)."""
    argv: list[str] = []
    for f, annotation in _fields(type(obj)):
        if not _is_cli(f, skip):
            continue
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(annotation):
            argv += dataclass_to_argv(value, skip)
            continue
        if f.default is not dataclasses.MISSING and value == f.default:
            continue
        if isinstance(value, bool):
            argv.append(_flag(f.name) if value else "--no-" + f.name.replace("_", "-"))
        elif isinstance(value, tuple):
            for item in value:
                argv += [_flag(f.name), str(item)]
        elif value is not None:
            argv += [_flag(f.name), str(value)]
    return argv
