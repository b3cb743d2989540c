"""A reward function of the tests' own (rollout.reward=prompt_rewards:by_source): it depends on the
prompt row's data_source only, so a run's rewards show that the row's fields reach it."""
from __future__ import annotations

REWARD = {"alpha": 1.0, "beta": 0.5, "saved": 0.75}


def by_source(record: dict, response_text: str) -> float:
    return REWARD.get(str(record.get("data_source")), 0.25)
