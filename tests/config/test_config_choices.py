"""`gspo-megatron config` lists a field's choices from its table (config/parsing.py CHOICES): every
loss, estimator, shipped reward, environment and transport with its description, and a row added
to a table shows up without another edit."""
from __future__ import annotations

import subprocess
import sys

import pytest

from gspo_megatron.algorithms.advantage.table import ESTIMATORS
from gspo_megatron.algorithms.registry import LOSSES
from gspo_megatron.config import describe_fields
from gspo_megatron.sync.transports import TRANSPORTS, TransportRow
from rollout.envs import ENVIRONMENTS
from rollout.rewards.registry import SHIPPED, Reward, RewardSpecError, ShippedReward, get_reward


def _line(text: str, section: str, field: str) -> str:
    lines = text.splitlines()
    start = lines.index(next(x for x in lines if x.startswith(f"{section}:")))
    return next(x for x in lines[start + 1:] if x.startswith(f"  {field}:"))


@pytest.mark.parametrize("section,field,rows", [
    ("loss", "name", {n: s.description for n, s in LOSSES.items() if s.rl}),
    ("loss", "advantage_estimator", {n: s.description for n, s in ESTIMATORS.items()}),
    ("rollout", "reward", {n: r.description for n, r in SHIPPED.items()}),
    ("rollout", "environment", {n: c.__doc__.strip().split("\n")[0].rstrip(".") for n, c in ENVIRONMENTS.items()}),
    ("sync", "transport", {n: r.description for n, r in TRANSPORTS.items()}),
])
def test_every_row_is_listed_with_its_description(section, field, rows):
    line = _line(describe_fields(), section, field)
    assert all(description for description in rows.values()), rows
    choices = line.split(" Choices: ", 1)[1]
    assert choices == "; ".join(f"{n}: {d}" for n, d in rows.items()) + "."


def test_a_new_row_is_listed_and_the_config_command_prints_the_tables(monkeypatch):
    monkeypatch.setitem(SHIPPED, "choice", ShippedReward("choice", lambda sandbox: Reward("choice", len),
                                                         "a letter A-J against the row's answer"))
    monkeypatch.setitem(TRANSPORTS, "toy", TransportRow("toy", "toy:ToyTransport", deltas=True))
    text = describe_fields()
    assert _line(text, "rollout", "reward").endswith("; choice: a letter A-J against the row's answer.")
    assert _line(text, "sync", "transport").endswith("; toy.")  # a row without a description: its name
    out = subprocess.run([sys.executable, "-m", "gspo_megatron.cli", "config"], capture_output=True,
                         text=True, check=True).stdout
    assert "choice" not in _line(out, "rollout", "reward") and "code: the response's program" in out


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


def test_a_field_without_a_table_has_no_choices():
    assert " Choices: " not in _line(describe_fields(), "rollout", "group_size")
