"""Reading a peer's file for `migrate`: its text (never a binary or an empty file), a YAML mapping
(a key given twice is named with both lines), and the words of a shell script, a file of flags or
of Hydra overrides (continuations, comments, several words per line, quotes), each with its line.

    text = read_text(path, "verl")                 # ConfigError: not a file, binary, empty
    data = yaml_mapping(text, path, "roll")        # the mapping, or None when the text is not one
    for line, words in shell_lines(text, path, "slime"):   # an unclosed quote: ConfigError, its line
        ...
    keys, lines = last_wins(found, "slime's argparse")     # a repeated key: the last value, and a line

Every refusal is one ConfigError naming the file, the line and what was expected (exit 2).
"""
from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import yaml

from gspo_megatron.config.parsing import ConfigError

SHELL_VARIABLE = re.compile(r"^[A-Z_][A-Z0-9_]*$")
"""A name a shell script assigns (`MODEL=/models/x`), not a Hydra key (lower-case, dotted)."""

Found = list[tuple[str, Any, int]]
"""(key, value, line) in file order."""


def read_text(path: Path, peer: str) -> str:
    """The file's text; ConfigError when it is not a file, not UTF-8 text or holds nothing but
    blanks and comments."""
    where = f"migrate --from {peer}: {str(path)!r}"
    if not path.is_file():
        raise ConfigError(f"{where} is not a file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{where} is not a text file (byte {e.start} is not UTF-8): expected the peer's "
                          "config as text") from None
    if "\x00" in text:
        raise ConfigError(f"{where} is not a text file (it holds NUL bytes): expected the peer's config as text")
    if not any(ln.strip() and not ln.strip().startswith("#") for ln in text.splitlines()):
        raise ConfigError(f"{where} is empty (only blanks and comments): nothing to migrate")
    return text


def _twice(node: yaml.Node | None, path: str = "") -> str | None:
    """The first key given twice in one mapping, with both lines (PyYAML would keep the last)."""
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key_node, value_node in node.value:
            key, line = str(key_node.value), key_node.start_mark.line + 1
            if key in seen:
                return f"the key '{path}{key}' appears twice (lines {seen[key]} and {line})"
            seen[key] = line
            found = _twice(value_node, f"{path}{key}.")
            if found:
                return found
    return None


def yaml_mapping(text: str, path: Path, peer: str, *, required: bool) -> dict[str, Any] | None:
    """The text's YAML mapping; None when it is not one (required=False: the caller reads it as
    lines), else ConfigError naming what it is instead."""
    where = f"migrate --from {peer}: {str(path)!r}"
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        if not required:
            return None
        raise ConfigError(f"{where} is not valid YAML: {' '.join(str(e).split())}") from None
    if not isinstance(data, dict):
        if not required:
            return None
        raise ConfigError(f"{where} is not a YAML mapping of {peer.upper() if peer == 'roll' else peer}'s keys "
                          f"(it reads as a {type(data).__name__})")
    twice = _twice(node)
    if twice:
        raise ConfigError(f"{where}: {twice}; the peer would keep only the second: merge the two into one")
    return data


def shell_lines(text: str, path: Path, peer: str) -> list[tuple[int, list[str]]]:
    """The shell words of each logical line (a trailing backslash continues it), with the number of
    its first line; comments dropped, quotes removed. An unclosed quote is a ConfigError."""
    out: list[tuple[int, list[str]]] = []
    logical, first = "", 0
    for number, raw in enumerate(text.splitlines(), start=1):
        if not logical:
            first = number
        stripped = raw.rstrip()
        if stripped.endswith("\\") and not stripped.endswith("\\\\"):
            logical += stripped[:-1] + " "
            continue
        logical += raw
        try:
            words = shlex.split(logical, comments=True)
        except ValueError as e:
            raise ConfigError(f"migrate --from {peer}: {str(path)!r} line {first}: {e} (an unclosed quote): "
                              f"{logical.strip()[:80]!r}") from None
        if words:
            out.append((first, words))
        logical = ""
    if logical.strip():
        try:
            words = shlex.split(logical, comments=True)
        except ValueError as e:
            raise ConfigError(f"migrate --from {peer}: {str(path)!r} line {first}: {e} (an unclosed quote)") from None
        if words:
            out.append((first, words))
    return out


def substitute(value: str, variables: dict[str, str]) -> str:
    """$NAME and ${NAME} of the script's own assignments replaced; the others left as written."""
    return re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?",
                  lambda m: variables.get(m.group(1), m.group(0)), value)


def last_wins(found: Found, who: str) -> tuple[dict[str, Any], list[str]]:
    """{key: its last value} in order of first appearance, and one `not carried` line for each
    earlier value of a repeated key (`who` keeps the last one, e.g. "Hydra", "slime's argparse")."""
    last: dict[str, tuple[Any, int, int]] = {}
    for i, (key, value, line) in enumerate(found):
        last[key] = (value, line, i)
    lines = [f"not carried  {key} = {value!r} (line {line}): given again on line {last[key][1]}; {who} keeps the "
             f"last value, {last[key][0]!r}" for i, (key, value, line) in enumerate(found) if last[key][2] != i]
    return {key: value for key, (value, _, _) in last.items()}, lines
