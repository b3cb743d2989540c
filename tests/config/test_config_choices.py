"""Every table (gspo_tables.TABLES) is found everywhere from its rows alone: `gspo-megatron config` lists
a field's choices from its table, every row with its description and its own settings; the config
checks a name against the live table; the docs' generated tables and the peers' vocabularies are read
off the rows. A row added at test time (each table's own kind of row, below) shows up in each of those
places without another edit, and a table added without a row here fails the test that counts them."""
from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from gspo_megatron.algorithms.advantage.table import EstimatorSpec
from gspo_megatron.algorithms.registry import LOSSES, RATIO_KEYS, LossSpec
from gspo_megatron.algorithms.terms import AggregationSpec, KLEstimatorSpec
from gspo_megatron.config import RunConfig, config_from_dict, describe_fields, field_docs
from gspo_megatron.config.parsing import TABLE, section_types
from gspo_megatron.config.peers.migration import peer_names
from gspo_megatron.sync.transports import TransportRow
from gspo_tables import TABLES, ConfigError, settings_fields
from model_specs.families import Family
from model_specs.features.attention import QKNorm
from rollout.envs import ENVIRONMENTS
from rollout.prompts.formats import PromptFormat
from rollout.prompts.rows import JsonlSource
from rollout.rewards.registry import REWARDS, Reward, RewardSpec, RewardSpecError, get_reward

from tools import docs_tables

ROOT = Path(__file__).resolve().parents[2]

BASE = {"model": {"hf_path": "/m"}, "rollout": {"prompts": "p.jsonl"}}


def _line(text: str, section: str, field: str) -> str:
    lines = text.splitlines()
    start = lines.index(next(x for x in lines if x.startswith(f"{section}:")))
    return next(x for x in lines[start + 1:] if x.startswith(f"  {field}:"))


def table_fields() -> list[tuple[str, str, dataclasses.Field]]:
    """(section, field, the field) of every config field whose value names a row of a table."""
    out = []
    for section, cls in section_types(RunConfig).items():
        if dataclasses.is_dataclass(cls):
            out += [(section, f.name, f) for f in dataclasses.fields(cls) if TABLE in f.metadata]
    return out


@pytest.mark.parametrize("section,field,f", table_fields(), ids=[f"{s}.{n}" for s, n, _ in table_fields()])
def test_every_row_is_listed_with_its_description_and_settings(section, field, f):
    from gspo_megatron.config.parsing import CHOICES_LABEL, CHOOSE
    table, choose = f.metadata[TABLE](), f.metadata.get(CHOOSE, lambda row: True)
    line = _line(describe_fields(), section, field)
    label = f.metadata.get(CHOICES_LABEL, "Choices")
    rows = [f"{n}: {d}" + (f" (settings: {', '.join(settings_fields(table[n]))})" if settings_fields(table[n]) else "")
            for n, d in table.choices().items() if choose(table[n])]
    assert all(table.choices().values()), table.choices()
    assert line.split(f" {label}: ", 1)[1] == "; ".join(rows) + "."


def test_the_config_command_prints_every_table():
    out = subprocess.run([sys.executable, "-m", "gspo_megatron.cli", "config"], capture_output=True,
                         text=True, check=True).stdout
    for section, field, _ in table_fields():
        assert _line(out, section, field) == _line(describe_fields(), section, field), (section, field)


@dataclass
class ToySettings:
    knob: int = 1
    """A toy setting."""


class ToyEnv:
    """A toy environment: one turn, reward 1.

    Its later lines are not listed."""

    name = "toy_env"

    def reset(self, record):
        return "go"

    def step(self, turn):
        return None


TOYS = {  # the table's what -> a row of it added at test time, the config field naming it, what it reads
    "loss": (LossSpec("toy_loss", "toy:toy_loss", None, "sequence", RATIO_KEYS, "a toy loss", settings=ToySettings),
             "loss", "name"),
    "loss aggregation": (AggregationSpec("toy-mean", "toy:toy", "sequences", "a toy aggregation"),
                         "loss", "loss_agg_mode"),
    "KL estimator": (KLEstimatorSpec("toy_kl", "toy:toy", "a toy KL", peers={"verl": ("toy_kl_verl",)}),
                     "loss", "kl_estimator"),
    "advantage estimator": (EstimatorSpec("toy_estimator", "group", "toy:toy", False, "a toy baseline",
                                          {"roll": ("toy_roll",)}, settings=ToySettings),
                            "loss", "advantage_estimator"),
    "weight-sync transport": (TransportRow("toy", "toy:ToyTransport", deltas=True, description="a toy transport",
                                           settings=ToySettings), "sync", "transport"),
    "reward": (RewardSpec("choice", lambda s: Reward("choice", len), "a letter A-J", settings=ToySettings),
               "rollout", "reward"),
    "environment": (ToyEnv, "rollout", "environment"),
    "prompt format": (PromptFormat("toy_format", lambda p: False, lambda p, c: JsonlSource(p), "a toy format"),
                      "rollout", "prompt_format"),
    "model family": (Family("toy_family", ("toy_a", "toy_b"), (QKNorm(),)), "model", "hf_path"),
}


def test_every_table_has_a_toy_row_here():
    docs_tables.all_tables()  # every table module imported
    assert set(TABLES) == set(TOYS), set(TABLES) ^ set(TOYS)


@pytest.mark.parametrize("what", list(TOYS))
def test_a_row_added_to_a_table_is_found_everywhere(what):
    table = docs_tables.all_tables()[what]
    row, section, field = TOYS[what]
    name = table._name_of(row)
    assert name not in _line(describe_fields(), section, field)
    with table.registered(row):
        line = _line(describe_fields(), section, field)
        own = " (settings: knob)" if getattr(row, "settings", None) else ""
        assert f"; {name}: {table.choices()[name]}{own}" in line, line  # listed, with its settings
        assert f"`{name}`" in docs_tables.render(table)  # the docs' generated table
        for peer, theirs in (getattr(row, "peers", None) or {}).items():
            assert peer_names(table, peer)[theirs[0]] == name  # the peers' vocabulary
        if field != "hf_path":  # a family is named by the model's config.json, not by a field
            value = {"loss_agg_mode": None, "kl_estimator": None}.get(field, name)
            if value is not None:  # the config takes its name, and its settings under the section
                data = {**BASE, section: {**BASE.get(section, {}), field: name}}
                args = {"name": "loss_args", "advantage_estimator": "estimator_args", "transport": "transport_args",
                        "reward": "reward_args"}.get(field)
                if args:
                    data[section][args] = {"knob": 3}
                    assert config_from_dict(data)
                    data[section][args] = {"knob": "many"}
                    with pytest.raises(ConfigError, match=rf"^{section}.{args}.knob='many': expected int"):
                        config_from_dict(data)
                else:
                    assert config_from_dict(data)
    assert name not in table and name not in _line(describe_fields(), section, field)


def test_an_unknown_name_is_refused_naming_the_live_rows():
    with LOSSES.registered(LossSpec("toy_loss", "toy:toy_loss", None, "sequence", RATIO_KEYS, "a toy loss")):
        with pytest.raises(ConfigError, match=r"loss.name='ppo': expected one of gspo, gspo_token, grpo, toy_loss, or "):
            config_from_dict(BASE, ["loss.name=ppo"])
    with REWARDS.registered(RewardSpec("choice", lambda s: Reward("choice", len), "a letter A-J")):
        with pytest.raises(RewardSpecError, match="'nope': expected one of math, exact_match, format, code, choice,"):
            get_reward("nope")


def test_a_row_named_by_reference_is_used_and_then_listed():
    ref = "rollout.envs.guessing:GuessingGameEnv"
    cfg = config_from_dict(BASE, [f"rollout.environment={ref}"])
    assert cfg.rollout.environment == ref and ref in ENVIRONMENTS
    assert f"; {ref}: Find a secret integer" in _line(describe_fields(), "rollout", "environment")


def test_no_field_lists_its_table_by_hand():
    """A docstring that names two of its field's rows is a list written by hand: it goes stale."""
    for section, field, f in table_fields():
        docs = field_docs(section_types(RunConfig)[section])
        named = [n for n in f.metadata[TABLE]() if re.search(rf"(?<![\w-]){re.escape(n)}(?![\w-])", docs[field])]
        assert len(named) < 2, f"{section}.{field}'s docstring names {named}"


def test_the_docs_generated_tables_are_current():
    assert docs_tables.main(["--check"]) == 0, "run python tools/docs_tables.py"


def test_a_field_without_a_table_has_no_choices():
    assert " Choices: " not in _line(describe_fields(), "rollout", "group_size")
