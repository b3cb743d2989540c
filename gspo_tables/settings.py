"""Settings dataclasses from plain data (a YAML mapping, `--set` values, what travels to a worker):
the run config's sections and every row's own settings are built by the same function.

    settings = build(CodeSandboxSettings, {"memory_mb": 512}, "rollout.reward_args.")
    settings = row_settings(ESTIMATORS["grpo"], {"group_std": "unbiased"}, "loss.estimator_args")

Types are checked, unknown keys named (with a close match), and a ValueError("field=value: expected
...") from the class's own __post_init__ comes out as a ConfigError with the prefix. A field whose
value names a row of a table says so in its metadata, `dataclasses.field(..., metadata={TABLE:
lambda: LOSSES})`: the value is checked against the live table when built (a plug-in's row
included), and `gspo-megatron config` lists the table's rows as the field's choices.
"""
from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import re
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, get_args, get_origin, get_type_hints

from gspo_errors import InputError
from gspo_tables.table import TableError


class ConfigError(InputError, ValueError):
    """A bad run configuration: the message names the field and the offending value."""


TABLE = "table"
"""Field metadata: a callable returning the Table whose rows the field's value names."""
CHOICES_LABEL = "choices_label"
"""Field metadata: what the rows listed for the field are ("Families"), where the value is not a
row's name but must match one (a model directory of a supported family)."""
SETTINGS_OF = "settings_of"
"""Field metadata of a `*_args` mapping: the name of the field whose row owns these settings."""
CHOOSE = "choose"
"""Field metadata: choose(row) -> bool, the rows of the TABLE the field may name (its choices)."""
CHECK = "check"
"""Field metadata: check(value, field) raising ValueError, in place of the TABLE's own lookup (a
field that also takes forms that are not rows: a reward's URL)."""


def type_name(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if get_origin(tp) in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in get_args(tp))
    if get_origin(tp) is list:
        return f"list[{type_name(get_args(tp)[0])}]"
    if get_origin(tp) is dict:
        return "mapping"
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, field: str) -> Any:
    """`value` as type `tp`, or ConfigError naming the field, the value and the expected type."""
    origin = get_origin(tp)
    bad = ConfigError(f"{field}={value!r}: expected {type_name(tp)}")
    if origin in (typing.Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, field)
            except ConfigError:
                pass
        raise bad
    if origin is Literal:
        if value in get_args(tp):
            return value
        raise bad
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise bad
        return dict(value)
    if origin is list:
        if isinstance(value, str):  # `--set a=x` for a one-element list
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise bad
        return [_coerce(v, get_args(tp)[0], f"{field}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise bad
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise bad
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-6" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                raise bad from None
        raise bad
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise bad
    raise bad


def section_types(cls: type) -> dict[str, Any]:
    """Field name -> type of a config dataclass (each annotation resolved in the module of the
    class that declares it, base classes included)."""
    return get_type_hints(cls)


def _unknown(key: str, known: list[str], where: str) -> ConfigError:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    if not known:
        return ConfigError(f"unknown key '{where}{key}': {where.rstrip('.')} takes no keys")
    return ConfigError(f"unknown key '{where}{key}'{hint}; known: {', '.join(known)}")


def build(cls: type, data: Any, prefix: str = "") -> Any:
    """An instance of config dataclass `cls` from a (YAML) mapping; nested dataclass fields are
    sections. Types are checked, a table's name checked against the live table, unknown keys named
    (with a close match), and a ValueError from the class's own validation comes out with the
    section prefix."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    hints = section_types(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if key not in fields:
            raise _unknown(str(key), list(fields), prefix)
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = build(tp, value, f"{prefix}{key}.")  # type: ignore[arg-type]
            continue
        kwargs[key] = _coerce(value, tp, f"{prefix}{key}")
        meta = fields[key].metadata
        if isinstance(kwargs[key], str) and CHOICES_LABEL not in meta and (TABLE in meta or CHECK in meta):
            try:  # the value against the live table: a plug-in's rows included
                if CHECK in meta:
                    meta[CHECK](kwargs[key], f"{prefix}{key}")
                else:
                    meta[TABLE]().row(kwargs[key], f"{prefix}{key}", meta.get(CHOOSE))
            except (TableError, ValueError) as e:
                raise ConfigError(str(e)) from None
    try:
        return cls(**kwargs)
    except ValueError as e:  # the class's own checks, a row's settings built in them included
        message = str(e)
        if isinstance(e, ConfigError) and prefix and message.startswith(prefix):
            raise
        unknown = "unknown key '"
        if message.startswith(unknown):  # a row's settings' unknown key, under this section
            message = unknown + prefix + message[len(unknown):]
        elif not re.match(r"^[\w.\[\]]+=", message):  # a message without the "field=value" form
            message = f"{prefix.rstrip('.') or 'config'}: {message}"
        elif not message.startswith(prefix):
            message = prefix + message
        raise ConfigError(message) from None


def row_settings(row: object, args: Mapping[str, Any] | None, field: str) -> Any:
    """The row's own settings (its `settings` dataclass) built from `args`, defaults for what is not
    given; None for a row without settings, whose `args` must then be empty. ConfigError names the
    field (`loss.estimator_args.group_std=...`)."""
    settings_type = getattr(row, "settings", None)
    if settings_type is None:
        if args:
            name = getattr(row, "name", row)
            raise ConfigError(f"{field}={dict(args)!r}: {name!r} takes no settings of its own")
        return None
    return build(settings_type, dict(args or {}), f"{field}.")


def settings_fields(row: object) -> dict[str, str]:
    """{field: its docstring's first sentence} of a row's settings (what `gspo-megatron config` lists)."""
    settings_type = getattr(row, "settings", None)
    if settings_type is None:
        return {}
    docs = field_docs(settings_type)
    return {f.name: docs.get(f.name, "") for f in dataclasses.fields(settings_type)}


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a config dataclass (read from the source, as Sphinx does),
    inherited fields included (a subclass's redeclaration wins)."""
    docs: dict[str, str] = {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):
        body = ast.parse(inspect.getsource(klass)).body[0].body  # type: ignore[attr-defined]
        for a, b in zip(body, body[1:]):
            if (isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name)
                    and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant)
                    and isinstance(b.value.value, str)):
                docs[a.target.id] = " ".join(b.value.value.split())
    return docs
