"""A LoRA run's checkpoints (gspo_megatron/checkpoint/lora_checkpoint.py) across layouts: saved by one
process and loaded under EP2 (1 -> 2), saved under EP2 and loaded under TP2 with sequence
parallelism, saved under each and loaded by one process (2 -> 1). Each time the adapters and the
merged policy's HF tensors come back bit for bit, and the next step from the loaded optimizer state
is the step the saving process took (1e-5). The base is referenced, never written: a checkpoint
names its files' CRC32s and refuses another base.

The PEFT folder a run exports (run/model_files.py export_peft, under EP2) is what a fresh run
imports (lora.init_peft: load_peft_adapters, in one process): the same adapters, bit for bit.

Three spawns: one rank, two ranks (EP2, then TP2 with expert-TP 1), one rank.
"""
from __future__ import annotations

import json

import pytest
import torch

from distributed import run_distributed
from fixtures_models import tiny_model_dir

TOL = 1e-5
def _np(d):
    return {k: v.numpy() for k, v in d.items()}


def _actor(layout: dict, hf):
    from gspo_megatron.actor.actor import Actor
    from gspo_megatron.actor.settings import OptimizerSettings
    from gspo_megatron.lora.lora_settings import LoraSettings
    from gspo_megatron.parallel.layout import ParallelLayout
    return Actor(hf, ParallelLayout(**layout), micro_batch_size=2, lora=LoraSettings(rank=4, alpha=8, experts="per_expert"),
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


def _state(actor, hf, name: str) -> dict:
    return {f"{name}_adapters": _np(actor.full_adapter_state_dict()), f"{name}_merged": _merged_hf(actor, hf)}


def _one_process_saves(rank, world, base, out):
    """One process: random B, a step, save `one`, a step (what a resumed run must repeat)."""
    from gspo_megatron.checkpoint import checkpoint_hf_config
    hf = checkpoint_hf_config(base)
    with _actor({}, hf) as actor:
        actor.load_weights(base)
        g = torch.Generator().manual_seed(3)
        actor.load_full_adapter_state_dict(
            {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in actor.full_adapter_state_dict().items()})
        _step(actor, 1)
        results = _state(actor, hf, "one")
        actor.save(f"{out}/one")
        _step(actor, 2)
        results["one_next"] = _np(actor.full_adapter_state_dict())
    return results


def _run_config(base, out, **lora):
    """The run's config of these actors (lora.rank 4, alpha 8, per-expert), with `lora` set."""
    from gspo_megatron.config import config_from_dict
    return config_from_dict({"model": {"hf_path": f"{base}/hf"},  # the converter's copy of the HF files
                             "rollout": {"prompts": f"{out}/prompts.jsonl"},
                             "lora": {"rank": 4, "alpha": 8, "experts": "per_expert", **lora}})


def _two_ranks(rank, world, base, out):
    """EP2 loads `one` (1 -> 2), exports it as PEFT as a run does, steps, saves `ep2`; TP2 (+SP)
    loads `ep2`, saves `tp2`, steps."""
    from types import SimpleNamespace

    from gspo_megatron.checkpoint import checkpoint_hf_config
    from gspo_megatron.run.model_files import export_peft
    hf = checkpoint_hf_config(base)
    results = {}
    for name, layout, source in (("ep2", dict(expert=2), "one"), ("tp2", dict(tensor=2, expert_tensor=1), "ep2")):
        with _actor(layout, hf) as actor:
            actor.load_weights(base)
            actor.load(f"{out}/{source}", None)
            if name == "ep2":
                cfg = _run_config(base, out, export_peft=f"{out}/peft")
                export_peft(SimpleNamespace(cfg=cfg, rank=rank, actor=actor))
            results.update(_state(actor, hf, f"{name}_loaded"))
            actor.save(f"{out}/{name}")
            _step(actor, 2)
            results[f"{name}_next"] = _np(actor.full_adapter_state_dict())
    return results


def _one_process_loads(rank, world, base, out, other_base):
    """One process loads `ep2` and `tp2` (2 -> 1) and steps from each; another base is refused."""
    from gspo_megatron.checkpoint import checkpoint_hf_config
    from gspo_megatron.checkpoint.model_io import CheckpointMismatchError
    hf = checkpoint_hf_config(base)
    results = {}
    with _actor({}, hf) as actor:  # a fresh run's import of the exported PEFT folder
        from gspo_megatron.run.model_files import load_peft_adapters
        actor.load_weights(base)
        load_peft_adapters(actor, _run_config(base, out, init_peft=f"{out}/peft"))
        results["peft_adapters"] = _np(actor.full_adapter_state_dict())
    with _actor({}, hf) as actor:
        actor.load_weights(base)
        for name in ("ep2", "tp2"):
            actor.load(f"{out}/{name}", None)
            results.update(_state(actor, hf, f"{name}_back"))
            _step(actor, 2)
            results[f"{name}_back_next"] = _np(actor.full_adapter_state_dict())
        actor.load_weights(other_base)
        try:
            actor.load(f"{out}/ep2", None)
        except CheckpointMismatchError as e:
            results["refused"] = str(e)
    return results


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


def _diff(a: dict, b: dict) -> float:
    return max(float(abs(a[k] - b[k]).max()) for k in a)


@pytest.mark.slow
def test_saved_in_one_layout_loaded_in_another(tmp_path):
    from gspo_megatron.checkpoint.convert import convert_hf_to_megatron
    base = convert_hf_to_megatron(tiny_model_dir("qwen3_moe", 0), tmp_path / "base")
    other = convert_hf_to_megatron(tiny_model_dir("qwen3_moe", 1), tmp_path / "other")
    one = run_distributed(_one_process_saves, 1, (str(base), str(tmp_path)), timeout=420)[0]
    two = run_distributed(_two_ranks, 2, (str(base), str(tmp_path)), timeout=420)[0]
    back = run_distributed(_one_process_loads, 1, (str(base), str(tmp_path), str(other)), timeout=420)[0]
    # 1 -> EP2 -> TP2 -> 1: the adapters and the merged policy's HF tensors bit for bit
    for got in ("ep2_loaded", "tp2_loaded", "ep2_back", "tp2_back"):
        src = two if got.endswith("loaded") else back
        assert _same(src[f"{got}_adapters"], one["one_adapters"]), got
        assert _same(src[f"{got}_merged"], one["one_merged"]), got
    # the next step from the loaded optimizer state is the saving run's (the Adam moments came along)
    moved = _diff(one["one_next"], one["one_adapters"])
    for got, ref in (("ep2_next", "one_next"), ("tp2_next", "one_next")):
        assert _diff(two[got], one[ref]) <= TOL < moved, (got, _diff(two[got], one[ref]), moved)
    for got in ("ep2_back_next", "tp2_back_next"):
        assert _diff(back[got], one["one_next"]) <= TOL, got
    assert _same(back["peft_adapters"], one["one_adapters"])  # exported under EP2, imported by one process
    assert "is not it: its files differ" in back["refused"]
    assert {p.name for p in (tmp_path / "one").iterdir()} >= {"base.json", "metadata.json"}
    assert not any(p.stat().st_size > 200_000 for p in (tmp_path / "one").iterdir())
    ref = json.loads((tmp_path / "one" / "base.json").read_text())
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
