"""Configuration fields that are also command-line flags: each is written once, as a dataclass field.

`option(default, help, ...)` makes a dataclass field whose metadata says how it reads on the command line;
`add_flags(parser, ConfigClass)` adds one flag per such field (its name, type, default, choices and help
from the field), and `values(ConfigClass, args)` reads them back as the class's keyword arguments.

Naming: the flag is `--field-name` unless `flag=` says otherwise (a True-by-default boolean is turned off by
its `--no-...` flag; a False-by-default one is turned on by its flag). The parsed value lands under the
field's own name (`args.enable_prefix_caching`), so a config is built from the namespace without a table
mapping flags to fields. Pure Python: building the CLI parser stays cheap.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

_KEY = "kvpool_flag"


@dataclasses.dataclass(frozen=True)
class Flag:
    help: str
    flag: str | None = None  # default: --field-name
    type: Callable[[str], Any] | None = None  # default: the default's type (int, float, str)
    choices: Sequence[Any] | Callable[[], Sequence[Any]] | None = None  # a callable is asked when the parser is built
    metavar: str | None = None
    action: str | None = None  # e.g. "append"
    nargs: str | int | None = None  # e.g. "+": a list field (`--lora-modules a=PATH b=PATH`)


def option(default: Any = None, help: str = "", *, flag: str | None = None, type: Callable[[str], Any] | None = None,
           choices: Sequence[Any] | Callable[[], Sequence[Any]] | None = None, metavar: str | None = None,
           action: str | None = None, nargs: str | int | None = None,
           default_factory: Callable[[], Any] | None = None) -> Any:
    """A dataclass field that is a command-line flag too (see the module doc)."""
    meta = {_KEY: Flag(help, flag, type, choices, metavar, action, nargs)}
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def flag_fields(cls: type) -> list[tuple[dataclasses.Field, Flag]]:
    """The fields of a config class that are flags, in declaration order."""
    return [(f, f.metadata[_KEY]) for f in dataclasses.fields(cls) if _KEY in f.metadata]


def _default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def add_flags(p: argparse.ArgumentParser | Any, cls: type, title: str | None = None) -> None:
    """One flag per flag field of `cls`, in an argument group named `title` (or straight into `p`)."""
    g = p.add_argument_group(title) if title else p
    for f, m in flag_fields(cls):
        default = _default(f)
        name = m.flag or "--" + f.name.replace("_", "-")
        kw: dict[str, Any] = {"dest": f.name, "help": m.help, "default": default}
        if isinstance(default, bool):
            kw["action"] = "store_false" if default else "store_true"
        else:
            if m.action:
                kw["action"] = m.action
            if m.nargs is not None:
                kw["nargs"] = m.nargs
            typ = m.type or (type(default) if isinstance(default, int | float) else None)
            if typ is not None:
                kw["type"] = typ
            if m.choices is not None:
                kw["choices"] = list(m.choices() if callable(m.choices) else m.choices)
            # (named after the flag, not the field: --kv-store-deadline SECONDS reads better than its dest)
            if m.metavar or "choices" not in kw:
                kw["metavar"] = m.metavar or name.lstrip("-").replace("-", "_").upper()
            if default is not None and "%(default)" not in m.help:
                kw["help"] = f"{m.help} (default: %(default)s)" if m.help else "(default: %(default)s)"
        g.add_argument(name, **kw)


def values(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The flag fields of `cls` as parsed: keyword arguments for `cls(...)` (fields not on the command line
    keep their defaults)."""
    return {f.name: getattr(args, f.name) for f, _ in flag_fields(cls) if hasattr(args, f.name)}
