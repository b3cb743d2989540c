"""Typed dataclass configs from YAML and `a.b=c` overrides: the generic machinery behind
gspo_megatron/config/schema.py (which holds the schema).

    data = apply_overrides(yaml_dict, ["train.steps=3"])   # values parsed as YAML
    cfg = build(RunConfig, data)                           # types checked, unknown keys named
    print(describe(RunConfig))                             # every field with its docstring

A field whose values are the names of a table (losses, rewards, transports, environments) says so
in its metadata, `dataclasses.field(..., metadata={CHOICES: fn})`, fn() -> {name: description}
read from the table when the config is described, so that the description lists every row and
nothing lists them by hand. A field whose value is not a row's name but must match one (a model
directory of a supported family) adds `CHOICES_LABEL: "Families"` to say what the rows are.

Every error is a ConfigError that names the field and the offending value. A section's dataclass
may validate itself in __post_init__ by raising ValueError("field=value: expected ..."); the
error comes out as a ConfigError with the section's prefix ("train.field=value: ...").
"""
from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

import yaml

from gspo_errors import InputError


class ConfigError(InputError, ValueError):
    """A bad run configuration: the message names the field and the offending value."""


CHOICES = "choices"
CHOICES_LABEL = "choices_label"


def choices_text(f: dataclasses.Field) -> str:
    """` Choices: name: description; ...` from the field's table (its CHOICES_LABEL for Choices), or ""."""
    table = f.metadata.get(CHOICES)
    if table is None:
        return ""
    rows = "; ".join(f"{n}: {d}" if d else n for n, d in table().items())
    return f" {f.metadata.get(CHOICES_LABEL, 'Choices')}: {rows}."


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
    return ConfigError(f"unknown key '{where}{key}'{hint}; known: {', '.join(known)}")


def build(cls: type, data: Any, prefix: str = "") -> Any:
    """An instance of config dataclass `cls` from a (YAML) mapping; nested dataclass fields are
    sections. Types are checked, unknown keys named (with a close match), and a ValueError from
    the class's own validation comes out with the section prefix."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    hints = section_types(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            raise _unknown(str(key), names, prefix)
        tp = hints[key]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            kwargs[key] = build(tp, value, f"{prefix}{key}.")
        else:
            kwargs[key] = _coerce(value, tp, f"{prefix}{key}")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except ValueError as e:
        message = str(e)
        if not re.match(r"^\w+=", message):  # a message without the "field=value" form
            message = f"{prefix.rstrip('.') or 'config'}: {message}"
        else:
            message = prefix + message
        raise ConfigError(message) from None


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b=c` -> (["a", "b"], value parsed as YAML: ints, floats, bools, lists, null)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected KEY=VALUE, e.g. train.steps=3")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not p for p in key.split(".")):
        raise ConfigError(f"override {text!r}: bad key {key!r}")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {text!r}: value is not valid YAML ({e})") from None
    return key.split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for part in path[:-1]:
            if not isinstance(node.get(part, {}), dict):
                raise ConfigError(f"override {text!r}: {part!r} is not a section")
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return data


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a config dataclass (read from the source, as Sphinx does),
    inherited fields included (a subclass's redeclaration wins)."""
    docs: dict[str, str] = {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):
        node = ast.parse(inspect.getsource(klass)).body[0]
        if not isinstance(node, ast.ClassDef):
            raise TypeError(f"{klass.__name__}'s source does not start with its class statement")
        body = node.body
        for a, b in zip(body, body[1:]):
            if (isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name)
                    and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant)
                    and isinstance(b.value.value, str)):
                docs[a.target.id] = " ".join(b.value.value.split())
    return docs


def describe(cls: type) -> str:
    """Every field of a config of sections: `section:` then `  name: default  # (type) doc`."""
    lines = []
    top_docs = field_docs(cls)
    defaults = cls()
    for sect in dataclasses.fields(cls):
        sect_cls = section_types(cls)[sect.name]
        lines.append(f"{sect.name}:  # {top_docs.get(sect.name, '')}")
        lines += _describe_fields(sect_cls, getattr(defaults, sect.name), "  ")
    return "\n".join(lines)


def _describe_fields(cls: type, defaults: Any, indent: str) -> list[str]:
    """`name: default  # (type) doc` per field; a nested dataclass is a sub-section, indented."""
    lines = []
    docs, hints = field_docs(cls), section_types(cls)
    for f in dataclasses.fields(cls):
        default = getattr(defaults, f.name)
        if dataclasses.is_dataclass(hints[f.name]):
            lines.append(f"{indent}{f.name}:  # {docs.get(f.name, '')}")
            lines += _describe_fields(hints[f.name], default, indent + "  ")
            continue
        lines.append(f"{indent}{f.name}: {default!r}  # ({type_name(hints[f.name])}) {docs.get(f.name, '')}"
                     f"{choices_text(f)}")
    return lines


def _duplicate_key(node: yaml.Node | None, path: str = "") -> str | None:
    """Where a key is given twice in one mapping of a composed YAML document, as the line the
    user sees, or None. YAML says keys are unique; PyYAML keeps the last one silently (two
    `model:` sections became the second alone, and "model.hf_path=''" then named the wrong thing)."""
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor` merges, it never clashes
                continue
            key, line = str(key_node.value), key_node.start_mark.line + 1
            if key in seen:
                return (f"the key '{path}{key}' appears twice (lines {seen[key]} and {line}); YAML keeps "
                        "only the second: merge the two into one")
            seen[key] = line
            found = _duplicate_key(value_node, f"{path}{key}.")
            if found:
                return found
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            found = _duplicate_key(item, f"{path.rstrip('.')}[{i}].")
            if found:
                return found
    return None


def read_yaml_mapping(path: str | Path) -> dict[str, Any]:
    """The top-level mapping of a YAML file, or ConfigError naming the file and what is wrong (a
    key given twice in one mapping too, with both lines)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        text = p.read_text(encoding="utf-8")
        twice = _duplicate_key(yaml.compose(text, Loader=yaml.SafeLoader))
        data = yaml.safe_load(text) or {}
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {str(p)!r} is not UTF-8 text ({e.reason} at byte "
                          f"{e.start})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(p)!r} is not valid YAML: "
                          f"{' '.join(str(e).split())}") from None
    if twice:
        raise ConfigError(f"config file {str(p)!r}: {twice}")
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(p)!r}: expected a mapping of sections, got "
                          f"{type(data).__name__}")
    return data
