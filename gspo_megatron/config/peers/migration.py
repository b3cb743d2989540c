"""What a migration collects: the peer's keys (flattened to dotted paths), our config's values,
and one line per key saying what became of it. The peers' vocabularies (roll.py, verl.py,
slime.py) read keys with `take` and say `carry` or `skip`; `finish` names every key left over, so
none is dropped without a line, and checks the result with the trainer's own config checks.
"""
from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import Any

import yaml

from gspo_megatron.config.parsing import ConfigError, apply_overrides
from gspo_megatron.config.loading import config_from_dict

def peer_names(table: Mapping[str, Any], peer: str) -> dict[str, str]:
    """{the peer's name: ours} for every row of `table` (losses, estimators, aggregations, KL
    estimators) whose `peers` names it: the vocabularies are read off the rows, never written here."""
    return {theirs: name for name, row in table.items() for theirs in getattr(row, "peers", {}).get(peer, ())}


# Fields the trainer needs that a peer's algorithm block need not hold (placeholders in the check).
REQUIRED = {"model.hf_path": "/path/to/hf-model", "rollout.prompts": "/path/to/prompts.jsonl"}
_INTERPOLATION = re.compile(r"^\$\{([A-Za-z0-9_.]+)\}$")


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """A nested mapping as {dotted.key: leaf value} (lists and scalars are leaves)."""
    if not isinstance(data, dict):
        return {prefix.rstrip("."): data} if prefix else {}
    out: dict[str, Any] = {}
    for k, v in data.items():
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def resolve_interpolations(flat: dict[str, Any]) -> dict[str, Any]:
    """Hydra/OmegaConf `${key}` values that name another key of the same file, resolved (ROLL's
    `max_new_tokens: ${response_length}`); anything else is left as written."""
    out = dict(flat)
    for _ in range(5):  # chains of references, a few deep
        for k, v in out.items():
            match = _INTERPOLATION.match(v) if isinstance(v, str) else None
            if match and match.group(1) in out and match.group(1) != k:
                out[k] = out[match.group(1)]
    return out


def _number(value: Any) -> Any:
    """A number YAML 1.1 read as a string ("1e-6", "3e-4") as a float; anything else as it is."""
    if isinstance(value, str) and re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?", value.strip()):
        return float(value)
    return value


@dataclass
class Migration:
    peer: str
    source: str
    keys: dict[str, Any]                      # the peer's keys, dotted, in file order
    values: dict[str, Any] = field(default_factory=dict)   # ours, dotted
    lines: list[str] = field(default_factory=list)
    taken: set[str] = field(default_factory=set)
    named: set[str] = field(default_factory=set)          # keys a line names
    known: dict[str, str] = field(default_factory=dict)     # key prefix -> why it has no counterpart
    carried_keys: set[str] = field(default_factory=set)   # input keys that became (or agree with) ours
    reader_lines: list[str] = field(default_factory=list)  # what reading the file found (repeats, words)
    unknown: int = 0                                       # input keys no rule and no prefix knows
    overrides: list[str] = field(default_factory=list)     # the user's --set KEY=VALUE, applied in finish

    def overridden(self, ours: str) -> bool:
        """The user sets our field `ours` with --set (a rule may then leave it to them)."""
        return any(o.split("=", 1)[0].strip() == ours for o in self.overrides)

    # --- what the vocabularies call --------------------------------------------------------------
    def has(self, key: str) -> bool:
        return key in self.keys

    def take(self, key: str, default: Any = None) -> Any:
        """The peer's value of `key` (default when absent), marked as read."""
        self.taken.add(key)
        return self.keys.get(key, default)

    def carry(self, key: str, ours: str, value: Any, how: str = "") -> None:
        """`key` became our `ours` = value (how: the formula or the peer's meaning)."""
        self.taken.add(key)
        self.named.add(key)
        if key in self.keys:
            self.carried_keys.add(key)
        value = _number(value)
        self.values[ours] = value
        shown = f"{key} = {self.keys[key]!r}" if key in self.keys else key
        self.lines.append(f"carried      {shown}  ->  {ours}: {value!r}" + (f"  ({how})" if how else ""))

    def also(self, key: str, ours: str, value: Any, how: str = "") -> None:
        """A second field of ours that `key` sets (its own line)."""
        self.values[ours] = value
        shown = f"{key} = {self.keys[key]!r}" if key in self.keys else key
        self.lines.append(f"carried      {shown}  ->  {ours}: {value!r}" + (f"  ({how})" if how else ""))

    def said(self, key: str, what: str) -> None:
        """`key` is carried as `what` says (no field of its own: a default that agrees, a no-op)."""
        if key not in self.keys:
            return
        self.taken.add(key)
        self.named.add(key)
        self.carried_keys.add(key)
        self.lines.append(f"carried      {key} = {self.keys[key]!r}  ->  {what}")

    def skip(self, key: str, why: str) -> None:
        """`key` is not carried, and why."""
        if key not in self.keys:
            return
        self.taken.add(key)
        self.named.add(key)
        self.lines.append(f"not carried  {key} = {self.keys[key]!r}: {why}")

    def estimator_setting(self, key: str, setting: str, value: Any, how: str) -> None:
        """`key` became the chosen estimator's own `setting` (loss.estimator_args), or is not carried
        where that estimator has no such setting (a knob that would do nothing is named, not kept)."""
        from gspo_megatron.algorithms.advantage.table import ESTIMATORS
        from gspo_tables import settings_fields
        ours = self.values.get("loss.advantage_estimator", "grpo")
        if ours in ESTIMATORS and setting in settings_fields(ESTIMATORS[ours]):
            self.carry(key, f"loss.estimator_args.{setting}", value, how)
        else:
            self.skip(key, f"our {ours} estimator takes no {setting} (only a return estimator discounts: "
                           f"{', '.join(n for n, r in ESTIMATORS.items() if setting in settings_fields(r))})")

    def note(self, text: str) -> None:
        self.lines.append(f"note         {text}")

    # --- the end -----------------------------------------------------------------------------------
    def finish(self, overrides: list[str]) -> None:
        """Name every key no rule read, apply `--set` overrides, and check the result with the
        trainer's config checks (placeholders for the fields the trainer needs that are missing)."""
        self.unknown = 0
        for key, value in self.keys.items():
            if key in self.named:
                continue
            if key in self.taken:  # read by a rule that named another key: say so, never nothing
                self.carried_keys.add(key)
                self.lines.append(f"carried      {key} = {value!r}  ->  read with the lines above")
                continue
            why = next((w for prefix, w in self.known.items() if key == prefix or key.startswith(prefix + ".")), None)
            if why is not None:
                self.lines.append(f"not carried  {key} = {value!r}: {why}")
            else:
                self.unknown += 1
                self.lines.append(f"unknown      {key} = {value!r}: not a {self.peer_name} key this migration "
                                  "knows; not carried")
        data = self.nested()
        apply_overrides(data, overrides)
        self.values = flatten(data)
        for text in overrides:
            self.lines.append(f"set          {text}  (--set)")
        missing = [k for k in REQUIRED if k not in self.values]
        if missing:
            self.lines.append(f"missing      {', '.join(missing)}: not in the {self.peer_name} input; set them "
                              "(--set KEY=VALUE, or in the YAML) before training")
        check = copy.deepcopy(data)
        apply_overrides(check, [f"{k}={v}" for k, v in REQUIRED.items() if k in missing])
        try:
            config_from_dict(check)
        except ConfigError as e:
            raise ConfigError(f"migrate --from {self.peer}: the translated config does not pass the trainer's "
                              f"checks: {e}") from None

    @property
    def peer_name(self) -> str:
        return {"roll": "ROLL", "verl": "verl", "slime": "slime"}[self.peer]

    def nested(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in self.values.items():
            node = out
            *path, last = key.split(".")
            for part in path:
                node = node.setdefault(part, {})
            node[last] = value
        return out

    def yaml(self) -> str:
        head = (f"# Migrated from {self.peer_name} ({self.source}) by `gspo-megatron migrate --from {self.peer}`:\n"
                "# what was carried, what was not and why is on its stderr (docs/algorithm.md,\n"
                "# \"Coming from ROLL, verl or slime\").\n")
        return head + yaml.safe_dump(self.nested(), sort_keys=False, default_flow_style=False)

    def summary(self) -> str:
        """One line: how many of the input's keys were carried, not carried, unknown."""
        n = len(self.keys)
        carried = len(self.carried_keys & set(self.keys))
        unknown = self.unknown
        return (f"summary      {n} key{'s' if n != 1 else ''} read: {carried} carried, {n - carried - unknown} "
                f"not carried, {unknown} unknown" + (f"; {len(self.reader_lines)} line(s) of the file not read as "
                                                    "keys (above)" if self.reader_lines else ""))

    def report(self) -> str:
        return "\n".join(f"[migrate] {line}" for line in [*self.reader_lines, *self.lines, self.summary()])


def carry_lora(m: Migration, rank_key: str, alpha_key: str, targets_key: str) -> None:
    """A peer's LoRA keys: its rank (0 or absent: no LoRA), alpha, and target modules as PEFT names
    (q_proj, ..., down_proj; a list or a comma-separated string; "all-linear" or "all": every
    linear layer). PEFT names become megatron's fused layers (lora/serving.py HF_MODULES): q_proj,
    k_proj or v_proj adapts linear_qkv, which holds all three with one A."""
    from gspo_megatron.lora.lora_settings import TARGETS
    from gspo_megatron.lora.serving import HF_MODULES
    rank = m.take(rank_key)
    if not rank:
        m.said(rank_key, "0: no LoRA (lora.rank: 0), as here by default")
        for key in (alpha_key, targets_key):
            m.skip(key, "acts only with a LoRA rank > 0")
        return
    m.carry(rank_key, "lora.rank", int(rank), "adapters on a frozen base")
    if m.has(alpha_key):
        m.carry(alpha_key, "lora.alpha", float(m.take(alpha_key)), "each adapter adds alpha / rank * B A x")
    if not m.has(targets_key):
        return
    value = m.take(targets_key)
    names = [n.strip() for n in (value.split(",") if isinstance(value, str) else value) if n.strip()]
    ours = {hf: t for t, hfs in HF_MODULES.items() for hf in hfs}
    if names in (["all-linear"], ["all"]):
        m.carry(targets_key, "lora.targets", list(TARGETS), "every linear layer (routed experts: lora.experts)")
        return
    unknown = [n for n in names if n not in ours and n not in TARGETS]
    targets = [t for t in TARGETS if any(ours.get(n, n) == t for n in names)]
    if not targets:
        m.skip(targets_key, f"none of {names} is a linear layer adapters sit on here ({', '.join(ours)})")
        return
    partial = [t for t in targets if t in HF_MODULES and not set(HF_MODULES[t]) <= set(names) and t != "linear_proj"]
    how = ("; ".join(f"{t} adapts {', '.join(HF_MODULES[t])} together" for t in partial)
           + (f"; not offered: {', '.join(unknown)}" if unknown else "")) or "PEFT names to megatron's layers"
    m.carry(targets_key, "lora.targets", targets, how)
