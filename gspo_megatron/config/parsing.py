"""Typed dataclass configs from YAML and `a.b=c` overrides: the generic machinery behind
gspo_megatron/config/schema.py (which holds the schema).

    data = apply_overrides(yaml_dict, ["train.steps=3"])   # values parsed as YAML
    cfg = build(RunConfig, data)                           # types checked, unknown keys named
    print(describe(RunConfig))                             # every field with its docstring

Building a dataclass from plain data is gspo_tables' (settings.py), shared with the rows' own
settings. A field whose values are the names of a table (losses, rewards, transports, ...) says so
in its metadata, `dataclasses.field(..., metadata={TABLE: lambda: LOSSES})`: the value is checked
against the live table when the config is built (a plug-in's rows included), and the description
lists every row, so nothing lists them by hand. A field whose value is not a row's name but must
match one (a model directory of a supported family) adds `CHOICES_LABEL: "Families"` to say what
the rows are.

Every error is a ConfigError that names the field and the offending value. A section's dataclass
may validate itself in __post_init__ by raising ValueError("field=value: expected ..."); the
error comes out as a ConfigError with the section's prefix ("train.field=value: ...").
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from gspo_tables import (CHECK, CHOICES_LABEL, CHOOSE, SETTINGS_OF, TABLE, ConfigError, build, field_docs, section_types, settings_fields,
                         type_name)

__all__ = ["CHECK", "CHOICES_LABEL", "CHOOSE", "SETTINGS_OF", "TABLE", "ConfigError", "apply_overrides", "build", "choices_text", "describe",
           "field_docs", "parse_override", "read_yaml_mapping", "section_types", "type_name"]


def choices_text(f: dataclasses.Field) -> str:
    """` Choices: name: description; ...` from the field's table (its CHOICES_LABEL for Choices), or
    "". A row with settings of its own lists them: `name: description (settings: a, b)`."""
    table = f.metadata.get(TABLE)
    if table is None:
        return ""
    rows = []
    choose = f.metadata.get(CHOOSE, lambda row: True)
    for name, description in table().choices().items():
        if not choose(table()[name]):
            continue
        own = settings_fields(table()[name])
        rows.append((f"{name}: {description}" if description else name)
                    + (f" (settings: {', '.join(own)})" if own else ""))
    return f" {f.metadata.get(CHOICES_LABEL, 'Choices')}: {'; '.join(rows)}."


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


def describe(cls: type) -> str:
    """Every field of a config of sections: `section:` then `  name: default  # (type) doc`."""
    return "\n".join(_describe_fields(cls, cls(), ""))


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
