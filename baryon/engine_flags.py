"""Engine flags for every command line (`baryon generate | chat | serve | bench`, the benchmark
scripts): one flag per `EngineArgs` field, same defaults and help, so the CLI and `LLM(**kwargs)`
cannot drift apart."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any

from baryon.config import EngineArgs


def _flag_type(field: dataclasses.Field) -> Any:
    hint = typing.get_type_hints(EngineArgs)[field.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)] if isinstance(hint, types.UnionType) else [hint]
    return args[0]


def add_engine_args(parser: argparse.ArgumentParser, defaults: dict[str, Any] | None = None,
                    omit: frozenset[str] = frozenset()) -> None:
    """One flag per EngineArgs field, but those in `omit` (fields that mean nothing to this
    command); `defaults` replaces some fields' defaults for this command."""
    group = parser.add_argument_group("engine")
    for field in dataclasses.fields(EngineArgs):
        if field.name in omit:
            continue
        flag = "--" + field.name.replace("_", "-")
        kind = _flag_type(field)
        help_text = field.metadata["help"]
        default = (defaults or {}).get(field.name, field.default)
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        elif typing.get_origin(kind) is list:
            group.add_argument(flag, type=typing.get_args(kind)[0], nargs="+", default=default, help=help_text)
        else:
            group.add_argument(flag, type=kind, default=default, help=f"{help_text} (default: {default})")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine arguments the command's flags set (an omitted field keeps its EngineArgs default)."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineArgs) if hasattr(args, f.name)}
