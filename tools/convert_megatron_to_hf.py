"""Export the model of a megatron dist_checkpointing checkpoint (any layout) to Hugging Face format.

    python tools/convert_megatron_to_hf.py --megatron /ckpt/qwen3-30b-mcore --out /models/exported

Writes model-0000i-of-0000N.safetensors shards (+ model.safetensors.index.json) or a single
model.safetensors, and the config / tokenizer files stored in the checkpoint's hf/ directory, so
`transformers.AutoModelForCausalLM.from_pretrained(OUT)` and SGLang load it directly. OUT is
written beside itself and renamed into place, marked by gspo_export.json: it may be new, empty or
an earlier export (replaced whole); any other non-empty folder is refused in one line.
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
    p.add_argument("--megatron", required=True, help="megatron checkpoint directory")
    p.add_argument("--out", required=True, help="output HF model directory: new, empty, or an earlier "
                   "export (replaced whole, never mixed); written beside it and renamed into place")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default=None,
                   help="cast weights to this dtype; default: as stored in the checkpoint")
    p.add_argument("--max-shard-gb", type=float, default=5.0, help="safetensors shard size limit")
    args = p.parse_args(argv)
    if not args.max_shard_gb > 0:  # a shard per tensor otherwise
        print(f"convert_megatron_to_hf: error: --max-shard-gb {args.max_shard_gb:g}: expected > 0",
              file=sys.stderr)
        return 2
    from gspo_megatron.run.expected_warnings import quiet_expected_warnings
    quiet_expected_warnings()  # as the trainer does: no TE / apex lines on a CPU machine
    from gspo_megatron.checkpoint.convert import run_tool
    from gspo_megatron.checkpoint.export import convert_megatron_to_hf
    from gspo_megatron.checkpoint.hf_files import DTYPES

    return run_tool("convert_megatron_to_hf", lambda: convert_megatron_to_hf(
        args.megatron, args.out, dtype=DTYPES.get(args.dtype),
        max_shard_bytes=int(args.max_shard_gb * (1 << 30))))


if __name__ == "__main__":
    sys.exit(main())
