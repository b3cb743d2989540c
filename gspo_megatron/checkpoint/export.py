"""Export a megatron dist_checkpointing checkpoint (any layout) to HF safetensors, in one process.

The model is described as in convert.py (a meta TP1 GPTModel's sharded state dict); parameters
are read with dist_checkpointing.load a few at a time (about `batch_bytes`), turned into HF tensors
by the family's weight map and written into safetensors shards as they arrive.

What is written is the checkpoint's dtype (or `dtype`), never a quantized format: a gpt-oss model
imported from MXFP4 (checkpoint/mxfp4.py) is exported as bf16 / fp32 experts under the
unquantized names (`gate_up_proj`, `down_proj`), and its config.json has no quantization_config
(the converter left it out of the checkpoint's copy).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import (ShardedTensor, ShardedTensorFactory,
                                                      apply_factories)
from tqdm import tqdm

from gspo_megatron.checkpoint.convert import check_map_covers, meta_model_state, \
    single_process_megatron
from gspo_megatron.checkpoint.hf_files import HFShardWriter, copy_metadata_files
from gspo_megatron.checkpoint.output_dirs import publish_dir
from gspo_megatron.checkpoint.model_io import (HF_SUBDIR, check_is_checkpoint, check_matches,
                                               checkpoint_hf_config)
from model_specs.weights.batches import weight_batches
from model_specs.weights.maps import WeightMapError, weight_map_for


def convert_megatron_to_hf(ckpt_dir: str | Path, out_dir: str | Path,
                           dtype: torch.dtype | None = None, batch_bytes: int = 1 << 30,
                           max_shard_bytes: int = 5 << 30, *, field: str = "--out",
                           protected: Mapping[str, str | Path | None] | None = None,
                           may_hold: Mapping[str, str | Path | None] | None = None) -> Path:
    """Write the model of a megatron checkpoint (any layout) as HF safetensors + metadata files.

    `out_dir` is published whole (output_dirs.publish_dir): written beside it, then renamed into
    place; it may be new, empty or an earlier export, and must not be or hold the checkpoint or
    anything in `protected` or `may_hold` (output_dirs.check_export_target; `field` names
    `out_dir` in errors)."""
    ckpt_dir, out_dir = Path(ckpt_dir), Path(out_dir)
    check_is_checkpoint(ckpt_dir)
    hf = checkpoint_hf_config(ckpt_dir)
    wmap = weight_map_for(hf)
    stored = dist_checkpointing.load_tensors_metadata(str(ckpt_dir))
    emb = stored.get("embedding.word_embeddings.weight")
    if emb is None:
        raise WeightMapError(f"{ckpt_dir} has no embedding.word_embeddings.weight: not a GPT model "
                             "checkpoint")
    return publish_dir(out_dir, lambda tmp: _write_hf(ckpt_dir, tmp, hf, wmap, emb.dtype, dtype,
                                                      batch_bytes, max_shard_bytes),
                       field=field, protected={"the checkpoint": ckpt_dir, **(protected or {})},
                       may_hold=may_hold or {}, source=str(ckpt_dir))


def _write_hf(ckpt_dir: Path, out_dir: Path, hf: dict, wmap, stored_dtype: torch.dtype,
              dtype: torch.dtype | None, batch_bytes: int, max_shard_bytes: int) -> None:
    with single_process_megatron():
        sharded_sd, params = meta_model_state(hf, stored_dtype)
        check_map_covers(wmap, params)
        check_matches(sharded_sd, ckpt_dir)
        copy_metadata_files(ckpt_dir / HF_SUBDIR, out_dir)
        mappings = list(wmap.mappings())

        def nbytes(m):
            return params[m.megatron].numel() * params[m.megatron].element_size()

        with HFShardWriter(out_dir, max_shard_bytes) as writer, \
                tqdm(total=len(mappings), desc="exporting to HF", unit="tensor") as bar:
            for batch in weight_batches(mappings, nbytes, batch_bytes, _together):
                loaded = _load_params(sharded_sd, [m.megatron for m in batch], ckpt_dir)
                pairs = [(m, loaded.pop(m.megatron)) for m in batch]
                for name, t in wmap.hf_tensors(pairs):  # a stacked tensor from all its experts
                    writer.add(name, t.to(dtype) if dtype else t)
                del pairs
                bar.update(len(batch))
    cfg = json.loads((out_dir / "config.json").read_text())
    cfg["dtype"] = str(dtype or stored_dtype).removeprefix("torch.")  # what the shards hold
    if "torch_dtype" in cfg:  # transformers < 5 spells it so
        cfg["torch_dtype"] = cfg["dtype"]
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def _together(m) -> str | None:
    """What must be in one batch with m: every expert of a layer's fc1 (fc2, their biases), which
    megatron saves under one key (`...mlp.experts.experts.linear_fc1.weight`, [E, ...]) and
    dist_checkpointing reads whole or not at all (torch's sharded tensor wants every shard of the
    key: "Number of local shards ... does not match"). Such a batch may pass batch_bytes: a
    Qwen3-235B layer's experts are 4.8 GB. It also keeps the experts of one stacked HF tensor
    together (gpt-oss: WeightMap.together_key)."""
    if not m.is_expert:
        return None
    return m.megatron.replace(f".local_experts.{m.expert}.", ".local_experts.*.")


def _load_params(sharded_sd: dict[str, Any], names: list[str], ckpt_dir: Path) -> dict:
    """Full (TP1) tensors of the named parameters, read from the checkpoint."""
    factories = {n: sharded_sd[n] for n in names if isinstance(sharded_sd[n], ShardedTensorFactory)}
    sub = {n: sharded_sd[n] for n in names}
    apply_factories(sub)  # meta views; loading allocates real tensors where data is None
    for sh in nested_values(sub):
        if isinstance(sh, ShardedTensor):
            sh.data = None
    loaded = dist_checkpointing.load(sub, str(ckpt_dir))
    for n, f in factories.items():
        loaded[n] = f.merge_fn(loaded[n])
    return loaded
