"""The pairing check of a sample's per-token records (rollout/generation/alignment.py): each kind
of misalignment is found and named at its first position; samples made of several calls (a
resumed partial, an episode with environment turns) pass. Samples from a live server, cut by
syncs and retracts: test_routes_paired.py."""
from __future__ import annotations

import re

import numpy as np
import pytest

from rollout.generation.alignment import misalignment
from rollout.generation.sample import Sample


def _routes(rows: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 4, (rows, 2, 2)).astype(np.int16)


def _episode() -> Sample:
    """prompt 3, a model turn of 2 at v1, 2 environment tokens, a model turn of 2 at v2."""
    s = Sample(0, 0, {}, [5, 6, 7], 20)
    s.append_model_tokens([1, 2], [-0.5, -0.25], ["1", "1"], _routes(4))
    s.append_env_tokens([9, 9])
    s.append_model_tokens([3, 4], [-0.125, -1.0], ["2", "2"], _routes(8, seed=1))
    return s


def test_samples_of_several_calls_are_paired():
    assert misalignment(_episode()) is None
    resumed = Sample(0, 1, {}, [5, 6, 7], 20)  # a partial response resumed after a sync
    resumed.append_model_tokens([1, 2], [-0.5, -0.25], ["1", "1"], _routes(4))
    resumed.append_model_tokens([3], [-0.5], ["2"], _routes(5, seed=2))
    assert misalignment(resumed) is None
    no_routes = Sample(0, 2, {}, [5], 4)
    no_routes.append_model_tokens([1, 2], [-0.5, -0.25], ["default", "default"])
    assert misalignment(no_routes) is None


def _set(name, index, value):
    return lambda s: getattr(s, name).__setitem__(index, value)


@pytest.mark.parametrize("spoil, expected", [
    (lambda s: s.logprobs.pop(), r"response position 5: 6 response ids but 5 log-probs"),
    (lambda s: s.weight_versions.append("2"), r"6 response ids but 7 weight versions"),
    (lambda s: setattr(s, "routed_experts", s.routed_experts[:-1]), r"9 tokens .* but 8 routed-experts rows"),
    (_set("loss_mask", 3, 1), r"response position 3 \(sequence position 6\): an environment token .* is trained"),
    (_set("logprobs", 2, -0.5), r"response position 2 .*environment token has log-prob -0.5"),
    (_set("logprobs", 4, float("nan")), r"response position 4 .*model token 3 has log-prob nan"),
    (_set("logprobs", 1, 0.5), r"response position 1 .*model token 2 has log-prob 0.5"),
    (_set("weight_versions", 5, "0"), r"response position 5 .*weight version 0 after a token of version 2"),
    (_set("routed_experts", (6, 1, 0), -1),
     r"response position 4 .*no route at input position 6, whose next token \(model token 3, version 2\)"),
    (_set("routed_experts", (4,), -1), None),  # it predicts an environment token: none needed
    (_set("routed_experts", (2,), -1),
     r"response position 0 .*no route at input position 2, whose next token \(model token 1, version 1\)"),
])
def test_each_misalignment_is_named_at_its_first_position(spoil, expected):
    s = _episode()
    spoil(s)
    problem = misalignment(s)
    assert (problem is None) if expected is None else re.search(expected, problem), problem


def test_routes_one_row_late_show_at_the_final_position():
    s = Sample(0, 0, {}, [5, 6, 7], 20)
    s.append_model_tokens([1, 2], [-0.5, -0.25], ["1", "1"], _routes(4))
    s.routed_experts = np.concatenate([_routes(1, seed=3), s.routed_experts[:-1]])  # shifted by one
    assert "a route at the final input position 4" in misalignment(s)
