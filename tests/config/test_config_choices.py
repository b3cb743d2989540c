"""`gspo-megatron config` lists a field's choices from its table (config/parsing.py CHOICES): every
loss, estimator, shipped reward, environment, transport and model family with its description, and
a row added to a table shows up without another edit."""
from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

import pytest

from gspo_megatron.algorithms.advantage.table import ESTIMATORS, EstimatorSpec
from gspo_megatron.algorithms.registry import LOSSES, LossSpec
from gspo_megatron.config import RunConfig, describe_fields, field_docs
from gspo_megatron.config.parsing import CHOICES, section_types
from gspo_megatron.sync.transports import TRANSPORTS, TransportRow
from model_specs.families import FAMILIES, Family
from model_specs.features.attention import QKNorm
from rollout.envs import ENVIRONMENTS
from rollout.rewards.registry import SHIPPED, Reward, RewardSpecError, ShippedReward, get_reward


def _line(text: str, section: str, field: str) -> str:
    lines = text.splitlines()
    start = lines.index(next(x for x in lines if x.startswith(f"{section}:")))
    return next(x for x in lines[start + 1:] if x.startswith(f"  {field}:"))


def _first_line(cls: type) -> str:
    return (cls.__doc__ or "").strip().split("\n")[0].rstrip(".")


def _family(f: Family) -> str:
    return f"model_type {' or '.join(f.model_types)} ({', '.join(type(x).__name__ for x in f.features)})"


LISTED = [  # section, field, label, the table's rows as the config lists them
    ("model", "hf_path", "Families", lambda: {n: _family(f) for n, f in FAMILIES.items()}),
    ("loss", "name", "Choices", lambda: {n: s.description for n, s in LOSSES.items() if s.rl}),
    ("loss", "advantage_estimator", "Choices", lambda: {n: s.description for n, s in ESTIMATORS.items()}),
    ("rollout", "reward", "Choices", lambda: {n: r.description for n, r in SHIPPED.items()}),
    ("rollout", "environment", "Choices", lambda: {n: _first_line(c) for n, c in ENVIRONMENTS.items()}),
    ("sync", "transport", "Choices", lambda: {n: r.description for n, r in TRANSPORTS.items()}),
    ("eval", "reward", "Choices", lambda: {n: r.description for n, r in SHIPPED.items()}),
]


@pytest.mark.parametrize("section,field,label,rows", LISTED, ids=[f"{s}.{f}" for s, f, _, _ in LISTED])
def test_every_row_is_listed_with_its_description(section, field, label, rows):
    line, rows = _line(describe_fields(), section, field), rows()
    assert all(description for description in rows.values()), rows
    assert line.split(f" {label}: ", 1)[1] == "; ".join(f"{n}: {d}" for n, d in rows.items()) + "."


class ToyEnv:
    """A toy environment: one turn, reward 1.

    Its later lines are not listed."""


ADDED = [  # the table, a row added at test time, the field that lists it, how it reads there
    (LOSSES, LossSpec("toy_loss", "toy:toy_loss", None, "sequence", ("num_sequences",), "a toy loss"),
     "loss", "name", "toy_loss: a toy loss"),
    (ESTIMATORS, EstimatorSpec("toy_estimator", "group", "toy:toy", False, "a toy baseline", "nobody's"),
     "loss", "advantage_estimator", "toy_estimator: a toy baseline"),
    (SHIPPED, ShippedReward("choice", lambda sandbox: Reward("choice", len), "a letter A-J"),
     "rollout", "reward", "choice: a letter A-J"),
    (ENVIRONMENTS, ToyEnv, "rollout", "environment", "toy_env: A toy environment: one turn, reward 1"),
    (TRANSPORTS, TransportRow("toy", "toy:ToyTransport", deltas=True, description="a toy transport"),
     "sync", "transport", "toy: a toy transport"),
    (FAMILIES, Family("toy_family", ("toy_a", "toy_b"), (QKNorm(),)),
     "model", "hf_path", "toy_family: model_type toy_a or toy_b (QKNorm)"),
]


@pytest.mark.parametrize("table,row,section,field,listed", ADDED, ids=[a[-1].split(":")[0] for a in ADDED])
def test_a_row_added_to_a_table_is_listed(monkeypatch, table, row, section, field, listed):
    name = listed.split(":")[0]
    assert name not in _line(describe_fields(), section, field)
    monkeypatch.setitem(table, name, row)
    assert _line(describe_fields(), section, field).endswith(f"; {listed}.")


def test_a_row_without_a_description_is_listed_by_its_name(monkeypatch):
    monkeypatch.setitem(TRANSPORTS, "toy", TransportRow("toy", "toy:ToyTransport", deltas=True))
    assert _line(describe_fields(), "sync", "transport").endswith("; toy.")


def test_a_new_shipped_reward_is_named_wherever_the_shipped_names_are(monkeypatch):
    """The names are listed from SHIPPED alone: rollout.reward's and eval.reward's choices in
    `gspo-megatron config` and get_reward's error for an unknown name (registry.py's and
    rollout/rewards' docstrings, and the peers' notes, point to the table instead)."""
    monkeypatch.setitem(SHIPPED, "choice", ShippedReward("choice", lambda sandbox: Reward("choice", len),
                                                         "a letter A-J against the row's answer"))
    text = describe_fields()
    for section in ("rollout", "eval"):
        assert _line(text, section, "reward").endswith("; choice: a letter A-J against the row's answer.")
    with pytest.raises(RewardSpecError, match="'code', 'choice'"):
        get_reward("no_such_reward")


def test_the_config_command_prints_every_table():
    out = subprocess.run([sys.executable, "-m", "gspo_megatron.cli", "config"], capture_output=True,
                         text=True, check=True).stdout
    for section, field, label, rows in LISTED:
        assert _line(out, section, field).endswith(
            f" {label}: " + "; ".join(f"{n}: {d}" for n, d in rows().items()) + "."), (section, field)


def test_no_field_lists_its_table_by_hand():
    """A docstring that names two of its field's rows is a list written by hand: it goes stale."""
    checked = 0
    for section, cls in section_types(RunConfig).items():
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            if CHOICES in f.metadata:
                named = [n for n in f.metadata[CHOICES]() if re.search(rf"\b{re.escape(n)}\b", docs[f.name])]
                assert len(named) < 2, f"{section}.{f.name}'s docstring names {named}"
                checked += 1
    assert checked == len(LISTED)


def test_a_field_without_a_table_has_no_choices():
    assert " Choices: " not in _line(describe_fields(), "rollout", "group_size")
