"""A LoRA run's checkpoints (gspo_megatron/checkpoint/lora_checkpoint.py): saved under EP2 and loaded under
one process, saved under TP2 (sequence parallel) and loaded under one process, the adapters come
back bit for bit, the next step from the loaded optimizer state is the step the saving run took
(1e-5), and the merged policy's HF tensors are identical in every layout. The base is referenced,
never written: a checkpoint names its files' CRC32s and refuses another base.

Two spawns: two ranks (EP2, then TP2 with expert-TP 1) and one rank.
"""
from __future__ import annotations

import json

import pytest
import torch

from distributed import run_distributed
from fixtures_models import tiny_model_dir

TOL = 1e-5
SETTINGS = dict(rank=4, alpha=8, experts="per_expert")


def _np(d):
    return {k: v.numpy() for k, v in d.items()}


def _actor(layout: dict, hf):
    from gspo_megatron.actor.actor import Actor
    from gspo_megatron.actor.settings import OptimizerSettings
    from gspo_megatron.lora.lora_settings import LoraSettings
    from gspo_megatron.parallel.layout import ParallelLayout
    return Actor(hf, ParallelLayout(**layout), micro_batch_size=2, lora=LoraSettings(**SETTINGS),
                 optimizer=OptimizerSettings(lr=1e-2, clip_grad=0.0), seed=5)


def _merged_hf(actor, hf) -> dict | None:
    """The merged policy's HF tensors (rank 0), from the base with every adapter merged in place."""
    from gspo_megatron.lora.merge import merged_in_place
    from model_specs.weights.maps import weight_map_for
    with merged_in_place(actor.models):
        full = actor.full_state_dict(to_all_ranks=False)
    if full is None:
        return None
    wmap = weight_map_for(hf)
    return _np(dict(wmap.hf_tensors([(m, full[m.megatron]) for m in wmap.mappings()])))


def _step(actor, seed):
    from test_weight_sync_sglang import _gspo_step
    _gspo_step(actor, seed)


def _saving(rank, world, base, out):
    """EP2: random B, a step, save `ep2`, a step; then TP2: load `ep2`, save `tp2`, a step."""
    from gspo_megatron.checkpoint import checkpoint_hf_config
    hf = checkpoint_hf_config(base)
    results = {}
    for name, layout in (("ep2", dict(expert=2)), ("tp2", dict(tensor=2, expert_tensor=1))):
        with _actor(layout, hf) as actor:
            actor.load_weights(base)
            if name == "ep2":
                g = torch.Generator().manual_seed(3)
                actor.load_full_adapter_state_dict(
                    {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in actor.full_adapter_state_dict().items()})
                _step(actor, 1)
            else:
                actor.load(f"{out}/ep2", None)
            results[f"{name}_saved"] = _np(actor.full_adapter_state_dict())
            results[f"{name}_merged"] = _merged_hf(actor, hf)
            actor.save(f"{out}/{name}")
            _step(actor, 2)
            results[f"{name}_next"] = _np(actor.full_adapter_state_dict())
    return results


def _loading(rank, world, base, out, other_base):
    from gspo_megatron.checkpoint import checkpoint_hf_config
    from gspo_megatron.checkpoint.model_io import CheckpointMismatchError
    hf = checkpoint_hf_config(base)
    results = {}
    with _actor({}, hf) as actor:
        actor.load_weights(base)
        for name in ("ep2", "tp2"):
            actor.load(f"{out}/{name}", None)
            results[f"{name}_loaded"] = _np(actor.full_adapter_state_dict())
            results[f"{name}_merged"] = _merged_hf(actor, hf)
            _step(actor, 2)
            results[f"{name}_next"] = _np(actor.full_adapter_state_dict())
        actor.load_weights(other_base)
        try:
            actor.load(f"{out}/ep2", None)
        except CheckpointMismatchError as e:
            results["refused"] = str(e)
    return results


@pytest.mark.slow
def test_saved_in_one_layout_loaded_in_another(tmp_path):
    from gspo_megatron.checkpoint.convert import convert_hf_to_megatron
    base = convert_hf_to_megatron(tiny_model_dir("qwen3_moe", 0), tmp_path / "base")
    other = convert_hf_to_megatron(tiny_model_dir("qwen3_moe", 1), tmp_path / "other")
    saved = run_distributed(_saving, 2, (str(base), str(tmp_path)), timeout=420)[0]
    loaded = run_distributed(_loading, 1, (str(base), str(tmp_path), str(other)), timeout=420)[0]
    for name in ("ep2", "tp2"):
        for k, v in saved[f"{name}_saved"].items():
            assert (loaded[f"{name}_loaded"][k] == v).all(), (name, k)
        for k, v in saved[f"{name}_merged"].items():
            assert (loaded[f"{name}_merged"][k] == v).all(), (name, k)
        worst = max(float(abs(loaded[f"{name}_next"][k] - v).max()) for k, v in saved[f"{name}_next"].items())
        moved = max(float(abs(saved[f"{name}_next"][k] - v).max()) for k, v in saved[f"{name}_saved"].items())
        assert worst <= TOL < moved, (name, worst, moved)
    assert saved["ep2_merged"].keys() == saved["tp2_merged"].keys()
    assert all((saved["tp2_merged"][k] == v).all() for k, v in saved["ep2_merged"].items())
    assert "is not it: its files differ" in loaded["refused"]
    files = {p.name for p in (tmp_path / "ep2").iterdir()}
    assert "base.json" in files and not any(p.stat().st_size > 200_000 for p in (tmp_path / "ep2").iterdir())
    ref = json.loads((tmp_path / "ep2" / "base.json").read_text())
    assert ref["path"] == str(base.resolve()) and ref["crc32"]


def test_a_base_reference_names_what_changed(tmp_path):
    from gspo_megatron.checkpoint.lora_checkpoint import BaseReference
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "w.bin").write_bytes(b"1234")
    before = BaseReference.of(tmp_path / "a")
    assert before.differs(BaseReference.of(tmp_path / "a")) == ""
    (tmp_path / "a" / "w.bin").write_bytes(b"1235")
    assert BaseReference.of(tmp_path / "a").differs(before) == "the bytes of w.bin differ (CRC32)"
    (tmp_path / "a" / "x.bin").write_bytes(b"")
    assert "its files differ (x.bin)" == BaseReference.of(tmp_path / "a").differs(before)
