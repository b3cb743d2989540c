"""Convert a Hugging Face checkpoint (safetensors) into a megatron dist_checkpointing checkpoint.

    python tools/convert_hf_to_megatron.py --hf /models/Qwen3-30B-A3B --out /ckpt/qwen3-30b-mcore

The result loads under any TP/PP/EP/VPP layout the model allows
(gspo_megatron.checkpoint.load_model); it holds the HF config and tokenizer in OUT/hf/ so that
tools/convert_megatron_to_hf.py can export it back. Runs in one process on CPU, tensor by tensor
(peak memory about one parameter), with a progress bar. Families: the rows of model_specs.FAMILIES
(`gspo-megatron config` lists them); a family of your own with --plugin MODULE.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# gspo_megatron/checkpoint/hf_files.py DTYPES, named here so that --help and a wrong argument are
# answered before torch and megatron-core are imported (3-9 s on a CPU machine)
DTYPE_NAMES = ("bfloat16", "float16", "float32")


def main(argv: list[str] | None = None) -> int:
    from tools.plugins import add_plugin_argument, import_plugin_args
    argv = import_plugin_args(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_plugin_argument(p)
    p.add_argument("--hf", required=True, help="HF model directory (config.json + *.safetensors)")
    p.add_argument("--out", required=True, help="output directory: new, empty, or an earlier output "
                   "of this tool (replaced whole); written beside it and renamed into place")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default=None,
                   help="store parameters in this dtype (float32, bfloat16, float16); default: "
                        "the HF tensors' dtype")
    args = p.parse_args(argv)
    from gspo_megatron.run.expected_warnings import quiet_expected_warnings
    quiet_expected_warnings()  # as the trainer does: no TE / apex lines on a CPU machine
    from gspo_megatron.checkpoint.convert import convert_hf_to_megatron, run_tool
    from gspo_megatron.checkpoint.hf_files import DTYPES

    return run_tool("convert_hf_to_megatron", lambda: convert_hf_to_megatron(
        args.hf, args.out, dtype=DTYPES.get(args.dtype)))


if __name__ == "__main__":  # dist_checkpointing may spawn helpers: keep the guard
    sys.exit(main())
