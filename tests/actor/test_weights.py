"""actor/weights/full.py: a full state dict loads into any layout and gathers back unchanged."""
from __future__ import annotations

import pytest
import torch

from distributed import run_distributed

pytestmark = pytest.mark.slow  # 0.19.2 runs the VPP round trip (suite time)


# Tensors returned through the launcher's queue are shared by file descriptor and vanish when the
# child exits: send numpy arrays.
def _to_np(state: dict | None) -> dict | None:
    return None if state is None else {k: v.numpy() for k, v in state.items()}


def _from_np(state: dict) -> dict:
    return {k: torch.from_numpy(v) for k, v in state.items()}


def _build(layout_kwargs: dict, seed: int):
    from gspo_megatron.actor.build import build_model_chunks
    from gspo_megatron.parallel.layout import ParallelLayout
    from gspo_megatron.parallel.process_groups import init_process_groups
    from gspo_megatron.actor.build import spec_for_layout
    from model_specs.hf.tiny import qwen3_moe as tiny_hf_config

    layout = ParallelLayout(**layout_kwargs)
    init_process_groups(layout, seed=seed)
    return build_model_chunks(spec_for_layout(tiny_hf_config(), layout), layout)


def _one_process_state(rank: int, world: int) -> dict:
    from gspo_megatron.actor.weights.full import full_state_dict

    full = _to_np(full_state_dict(_build({}, seed=7)))
    assert full is not None  # to every rank
    return full


def _round_trip(rank: int, world: int, layout_kwargs: dict, full: dict) -> dict | None:
    from gspo_megatron.actor.weights.full import full_state_dict, load_full_state_dict

    chunks = _build(layout_kwargs, seed=1000 + rank)  # different init: loading must overwrite it
    load_full_state_dict(chunks, _from_np(full))
    return _to_np(full_state_dict(chunks, to_all_ranks=False))


@pytest.fixture(scope="module")
def one_process_state() -> dict:
    return run_distributed(_one_process_state, 1, timeout=120)[0]


@pytest.mark.parametrize("world,layout", [
    (4, dict(tensor=2, expert=2)),                          # TP shards incl. strided fc1, experts
    pytest.param(4, dict(pipeline=2, virtual_pipeline=2, expert=2, expert_tensor=1),  # global layer indices
                 marks=pytest.mark.mcore019),
])
def test_full_state_dict_round_trip(one_process_state, world, layout):
    back = run_distributed(_round_trip, world, (layout, one_process_state), timeout=240)[0]
    assert list(back) == list(one_process_state)
    for name, tensor in one_process_state.items():
        assert (back[name] == tensor).all(), name


def _bad_load(rank: int, world: int, full: dict) -> str:
    from gspo_megatron.actor.weights.full import load_full_state_dict

    chunks = _build(dict(tensor=2), seed=1)
    broken = _from_np(full)
    broken.pop("decoder.layers.1.mlp.router.weight")
    broken["extra.weight"] = torch.zeros(1)
    try:
        load_full_state_dict(chunks, broken)
    except ValueError as e:
        return str(e)
    return "no error"


def test_load_names_missing_and_unused_entries(one_process_state):
    msg = run_distributed(_bad_load, 2, (one_process_state,), timeout=120)[0]
    assert "missing decoder.layers.1.mlp.router.weight" in msg
    assert "extra.weight" in msg
