"""HF safetensors -> megatron dist_checkpointing conversion, in one process, tensor by tensor.

Both directions describe the model by the sharded state dict of a TP1/PP1/EP1 GPTModel built on
the `meta` device (no memory, no initialisation): its keys and global shapes are exactly what the
trainer's load_model() asks for under any layout, so nothing about megatron's checkpoint key scheme
is re-implemented here. Only the weights differ: they come from (or go to) the HF files through the
family's weight map (model_specs/weights/maps.py), one megatron parameter at a time.

- HF -> megatron: megatron's own dist_checkpointing.save (validation, common.pt, metadata.json)
  with a save strategy whose planner resolves each tensor lazily from the HF files at the moment
  torch.distributed.checkpoint writes it, one file per tensor: peak memory is about one parameter.
- megatron -> HF: see export.py.

gpt-oss's stacked experts: each expert's parameter is a slice of one HF tensor per layer
(model_specs/weights/maps.py), read once and kept while its experts are written; MXFP4 ones
(the published checkpoints) are dequantized on reading (mxfp4.py).
"""
from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.strategies.torch import MCoreSavePlanner
from torch.distributed.checkpoint.planner import WriteItemType
from tqdm import tqdm

from gspo_megatron.checkpoint.hf_files import HFTensorReader, TensorReader, copy_metadata_files
from gspo_megatron.checkpoint.model_io import HF_SUBDIR, TorchDcpSaveStrategy, without_extra_state
from gspo_megatron.checkpoint.mxfp4 import StackedExpertsReader, is_mxfp4
from gspo_megatron.checkpoint.output_dirs import publish_dir
from gspo_megatron.parallel.cpu_compat import cpu_config_overrides, current_device_is_cpu
from gspo_errors import MissingInputError
from model_specs import load_hf_config, model_spec_for
from model_specs.weights.maps import WeightMap, WeightMapError, weight_map_for


@contextlib.contextmanager
def single_process_megatron() -> Iterator[None]:
    """A world-size-1 gloo group with megatron's TP1/PP1/EP1 parallel state (offline tools)."""
    if dist.is_initialized():
        raise RuntimeError("the checkpoint converters run in their own process, outside "
                           "torch.distributed")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def meta_model_state(hf: dict[str, Any], dtype: torch.dtype) -> tuple[dict[str, Any], dict]:
    """(sharded state dict without _extra_state, {param name: meta tensor}) of a TP1 GPTModel."""
    from megatron.core.models.gpt import GPTModel

    # The alltoall dispatcher creates a CUDA stream when built; the dispatcher holds no weights.
    overrides = dict(cpu_config_overrides() if not torch.cuda.is_available() else {},
                     use_cpu_initialization=True, perform_initialization=False,
                     moe_token_dispatcher_type="allgather")
    # The local spec, also where Transformer Engine imports: TE's layers cannot be built on the
    # meta device ("Cannot copy out of meta tensor"), and both specs have the same checkpoint keys
    # (model_specs.norms.te_checkpoint_keys), so the result loads into either.
    spec = model_spec_for(hf, params_dtype=dtype, overrides=overrides, transformer_engine=False)
    with torch.device("meta"), current_device_is_cpu():
        model = GPTModel(spec.config, spec.block_spec(None), pre_process=True, post_process=True,
                         **spec.gpt_model_kwargs())
    sd = without_extra_state(model.sharded_state_dict())
    return sd, dict(model.named_parameters())


def check_map_covers(wmap: WeightMap, params: dict[str, torch.Tensor]) -> None:
    mapped = set(wmap.by_megatron_name())
    if mapped != set(params):
        raise WeightMapError(f"weight map of {wmap.family} does not match the megatron model: "
                             f"unmapped parameters {sorted(set(params) - mapped)}, mapped names "
                             f"the model lacks {sorted(mapped - set(params))}")


# ---------------------------------------------------------------- HF -> megatron
class _LazySavePlanner(MCoreSavePlanner):
    """Resolves each write item's tensor from the source when the writer asks for it."""

    def __init__(self, pieces: dict, load_param: Callable[[str], torch.Tensor], total: int) -> None:
        super().__init__(flatten_state_dict=False)
        self.pieces = pieces  # (checkpoint key, global offset) -> (param name, slices)
        self.load_param = load_param
        self.progress = tqdm(total=total, desc="writing megatron checkpoint", unit="tensor")

    def resolve_data(self, write_item):
        if write_item.type == WriteItemType.BYTE_IO:
            return super().resolve_data(write_item)
        name, slices = self.pieces[(write_item.index.fqn, tuple(write_item.index.offset))]
        piece = self.load_param(name)[slices]
        self.progress.update(1)
        return piece.reshape(tuple(write_item.tensor_data.chunk.sizes)).contiguous()


def _rows_before(sh: ShardedTensor, key: str) -> int:
    """Where a piece of a parameter that megatron's sharded state dict splits into keys of their
    own begins in it (rows): a Gated DeltaNet's in_proj and conv1d are saved as `.query`,
    `.key`, ... (gated_delta_net.py, _split_tensor_factory), each key's offsets counted from its
    own start; its data is a view of the parameter along dim 0, whose storage offset says where.
    (A piece whose offsets already say where, as the gated fc1's [gate; up] halves under one key,
    is left as it is.)"""
    data = sh.data
    if any(sh.global_offset[sh.prepend_axis_num:]) or data is None or data.dim() == 0 \
            or data.storage_offset() == 0:
        return 0
    rows, rest = divmod(data.storage_offset(), data.stride(0))
    if rest:
        raise ValueError(f"{key}: a piece of its parameter that does not start at a row")
    return rows


class _StreamingSaveStrategy(TorchDcpSaveStrategy):
    """One file per tensor, each tensor produced from the HF files when it is written."""

    def __init__(self, load_param: Callable[[str], torch.Tensor]) -> None:
        super().__init__(single_file_per_rank=False)
        self.load_param = load_param

    def make_planner(self, by_key, flat_mapping, rename_mapping) -> _LazySavePlanner:
        pieces = {}
        for key, shards in by_key.items():
            for sh, flat_key in zip(shards, rename_mapping[key]):
                if not isinstance(sh, ShardedTensor):
                    # megatron-core 0.19 adds ShardedObjects of its own to what save() writes;
                    # they carry their bytes and are written as they are (BYTE_IO items).
                    continue
                # At TP1 a parameter is the whole global tensor minus the prepended (layer /
                # expert) axes, so a shard's offsets past those axes index into the parameter.
                offs = list(sh.global_offset[sh.prepend_axis_num:])
                offs[0] += _rows_before(sh, key)
                slices = tuple(slice(o, o + n) for o, n in zip(offs, sh.local_shape))
                pieces[(key, tuple(sh.global_offset))] = (flat_mapping[flat_key][0], slices)
        self.planner = _LazySavePlanner(pieces, self.load_param, total=len(pieces))
        return self.planner

    def save(self, sharded_state_dict, checkpoint_dir) -> None:
        try:
            super().save(sharded_state_dict, checkpoint_dir)
        finally:  # also on a failed write: the bar ends its line before any error is printed
            if hasattr(self, "planner"):
                self.planner.progress.close()


def convert_hf_to_megatron(hf_dir: str | Path, out_dir: str | Path,
                           dtype: torch.dtype | None = None, *, field: str = "--out",
                           hf_field: str = "--hf") -> Path:
    """Write HF safetensors at hf_dir as a megatron checkpoint at out_dir (+ out_dir/hf/).

    `out_dir` is published whole (output_dirs.publish_dir): new, empty or an earlier output of
    this project, never the HF model or a folder holding it (`field` names it in errors, `hf_field`
    names hf_dir). A tensor the checkpoint cannot hold exactly (an integer one) is refused."""
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    if hf_dir.is_file():
        raise MissingInputError(f"{hf_field}={str(hf_dir)!r} is a file, not a folder: give the Hugging "
                                f"Face model folder (config.json and *.safetensors), e.g. {str(hf_dir.parent)!r}")
    hf = load_hf_config(hf_dir)
    wmap = weight_map_for(hf)
    hf_reader = HFTensorReader(hf_dir)
    _check_float_tensors(hf_reader, wmap)
    reader: TensorReader = hf_reader
    by_name = wmap.by_megatron_name()
    dtype = dtype or reader.dtype(by_name["embedding.word_embeddings.weight"].hf[0])
    if any(m.stacked for m in by_name.values()):  # gpt-oss: MXFP4 dequantized, stacks read once
        reader = StackedExpertsReader(hf_reader, dtype)
    _check_unused_hf(reader, wmap, hf)
    return publish_dir(out_dir, lambda tmp: _write_megatron(hf_dir, tmp, hf, wmap, reader, dtype),
                       field=field, protected={"the HF model": hf_dir}, source=str(hf_dir))


def _write_megatron(hf_dir: Path, out_dir: Path, hf: dict, wmap: WeightMap, reader: TensorReader,
                    dtype: torch.dtype) -> None:
    by_name = wmap.by_megatron_name()
    # megatron writes metadata.json last: a checkpoint interrupted before it is not loadable.
    copy_metadata_files(hf_dir, out_dir / HF_SUBDIR)
    if is_mxfp4(hf):  # the checkpoint holds the dequantized weights (checkpoint/mxfp4.py)
        config = json.loads((out_dir / HF_SUBDIR / "config.json").read_text())
        del config["quantization_config"]
        (out_dir / HF_SUBDIR / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    with single_process_megatron():
        sharded_sd, params = meta_model_state(hf, dtype)
        check_map_covers(wmap, params)
        _check_hf_shapes(reader, wmap, params)  # before anything is written
        cache: dict[str, torch.Tensor] = {}

        def load_param(name: str) -> torch.Tensor:
            if name not in cache:  # the two halves of a fused fc1 are written one after another
                m = by_name[name]
                hf_tensors = [reader.get(n) for n in m.hf]
                cache.clear()
                # the checkpoint's dtype, except where megatron keeps fp32 (the expert bias)
                cache[name] = wmap.to_megatron(m, hf_tensors).to(params[name].dtype)
            return cache[name]

        dist_checkpointing.save(sharded_sd, str(out_dir),
                                sharded_strategy=_StreamingSaveStrategy(load_param))


def _check_hf_shapes(reader: TensorReader, wmap: WeightMap, params: dict) -> None:
    for m in wmap.mappings():
        for name, shape in zip(m.hf, wmap.hf_shapes(m, params[m.megatron].shape)):
            reader.get_shape_checked(name, shape)


def _check_float_tensors(reader: HFTensorReader, wmap: WeightMap) -> None:
    """An integer (or bool) HF tensor the map turns into a parameter: megatron's parameters are
    floating point, so the conversion would change its values' type (int32 -> float32, silently,
    and exactly only below 2^24); refused, naming it. MXFP4's packed uint8 blocks and scales are
    read by the stacked experts' reader (mxfp4.py), under other names."""
    for name in wmap.hf_names():
        kind = reader.stored_dtype(name) if name in reader.file_of else None
        if kind is not None and not kind.startswith(("F", "BF")):
            shown = INTEGER_DTYPES.get(kind, kind)
            raise WeightMapError(f"HF tensor {name} in {reader.dir / reader.file_of[name]} is {shown}: "
                                 "the megatron checkpoint holds floating-point parameters, and converting "
                                 f"would change its values; refused (store it as a float tensor)")


INTEGER_DTYPES = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16",
                  "I32": "int32", "U32": "uint32", "I64": "int64", "U64": "uint64"}  # safetensors' names


def _check_unused_hf(reader: TensorReader, wmap: WeightMap, hf: dict[str, Any]) -> None:
    """HF tensors that the map does not consume mean a model the map does not describe."""
    unused = set(reader.names) - set(wmap.hf_names())
    unused = {n for n in unused if not wmap.ignores_hf(n)}  # recomputed buffers, GLM-4.5's MTP layers
    if hf.get("tie_word_embeddings"):
        unused.discard("lm_head.weight")  # some exporters store the tied head anyway
    if unused:
        raise WeightMapError(f"HF checkpoint {reader.dir} has tensors the {wmap.family} weight map "
                             f"does not use (another architecture or config?): {sorted(unused)[:10]}")


def run_tool(prog: str, convert: Callable[[], Path]) -> int:
    """A converter's command line: print the output folder and return 0, or one line
    `PROG: error: ...` (a wrong path, a model the map does not describe, an output folder that
    must not be replaced, a full disk) and return 2; anything else keeps its traceback."""
    from gspo_megatron.checkpoint.hf_files import DamagedFileError
    from gspo_megatron.checkpoint.manager import write_failure_kind
    from gspo_megatron.checkpoint.model_io import CheckpointMismatchError
    from gspo_megatron.checkpoint.output_dirs import OutputDirError
    from model_specs import HFConfigError
    known = (FileNotFoundError, NotADirectoryError, OutputDirError, WeightMapError, HFConfigError,
             CheckpointMismatchError, DamagedFileError)
    try:
        print(convert())
        return 0
    except BaseException as e:  # noqa: BLE001 - torch's CheckpointException is a BaseException
        if isinstance(e, known):
            message = " ".join(str(e).split()) if "\n" not in str(e) else str(e).strip()
        elif any(write_failure_kind(e)):
            message = f"no space left on device while writing ({e.__class__.__name__}); free space and rerun"
        else:
            raise
        print(f"{prog}: error: {message}", file=sys.stderr)
        return 2
