"""MXFP4 expert weights (gpt-oss's published checkpoints) dequantized on import.

    reader = StackedExpertsReader(HFTensorReader(hf_dir), torch.bfloat16)
    reader.get("model.layers.0.mlp.experts.gate_up_proj")       # [E, h, 2f] bf16, from MXFP4

gpt-oss's published checkpoints (`quantization_config.quant_method: mxfp4`) store each stacked
expert tensor X as `X_blocks` (uint8 [E, rows, G, 16]: 32 four-bit E2M1 values a block, the low
nibble first) and `X_scales` (uint8 [E, rows, G]: one power-of-two exponent a block, biased by
127); X is their product over the blocks, transposed to [E, G x 32, rows] (transformers'
integrations/mxfp4.py, convert_moe_packed_tensors, which tests/checkpoint/test_convert_gpt_oss.py
holds this against). The trainer holds the dequantized weights in the checkpoint's other dtype (bf16):
every E2M1 value times a power of two is exact there. Export writes them so, unquantized
(checkpoint/export.py); the converter leaves quantization_config out of the checkpoint's copy of
config.json.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from gspo_megatron.checkpoint.hf_files import HFTensorReader
from model_specs.weights.maps import WeightMapError

# E2M1: sign, 2 exponent bits, 1 mantissa bit (the OCP microscaling formats' FP4)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCKS, SCALES = "_blocks", "_scales"


def is_mxfp4(hf_config: Mapping[str, Any]) -> bool:
    quant = hf_config.get("quantization_config")
    return isinstance(quant, Mapping) and quant.get("quant_method") == "mxfp4"


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor,
                     dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """blocks uint8 [E, rows, G, 16], scales uint8 [E, rows, G] -> [E, G x 32, rows] (module
    docstring)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise WeightMapError(f"MXFP4 blocks / scales must be uint8, got {blocks.dtype} / {scales.dtype}")
    if blocks.dim() != 4 or blocks.shape[-1] != 16 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise WeightMapError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)}: "
                             "expected [E, rows, G, 16] and [E, rows, G]")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    nibbles = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()    # [E, rows, G, 16, 2]
    values = lut[nibbles].flatten(-2)                                     # [E, rows, G, 32]
    exponents = scales.to(torch.int32)[..., None] - 127                   # [E, rows, G, 1]
    out = torch.ldexp(values, exponents.float()).flatten(-2)              # [E, rows, G x 32]
    return out.to(dtype).transpose(1, 2).contiguous()                     # [E, G x 32, rows]


class StackedExpertsReader:
    """An HFTensorReader for checkpoints with stacked experts (gpt-oss): MXFP4 pairs (X_blocks,
    X_scales) read as X, dequantized, and the last tensor read is kept, since each expert's
    parameter is cut from the same stacked tensor, one expert after another."""

    def __init__(self, reader: HFTensorReader, dtype: torch.dtype) -> None:
        self.reader, self.dtype_ = reader, dtype
        self.dir = reader.dir
        names = set(reader.names)
        self.quantized = {n[:-len(BLOCKS)] for n in names
                          if n.endswith(BLOCKS) and n[:-len(BLOCKS)] + SCALES in names}
        self._last: tuple[str, torch.Tensor] | None = None

    @property
    def names(self) -> list[str]:
        hidden = {q + s for q in self.quantized for s in (BLOCKS, SCALES)}
        return [n for n in self.reader.names if n not in hidden] + sorted(self.quantized)

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.quantized:
            return self.reader.shape(name)
        experts, rows, groups, _ = self.reader.shape(name + BLOCKS)
        return (experts, groups * 32, rows)

    def dtype(self, name: str) -> torch.dtype:
        return self.dtype_ if name in self.quantized else self.reader.dtype(name)

    def get_shape_checked(self, name: str, expected_shape: Sequence[int]) -> None:
        if self.shape(name) != tuple(expected_shape):
            raise WeightMapError(f"HF tensor {name} in {self.dir} has shape {self.shape(name)} "
                                 f"(dequantized), the config implies {tuple(expected_shape)}")

    def get(self, name: str) -> torch.Tensor:
        if self._last is None or self._last[0] != name:
            self._last = None  # one stacked tensor in memory at a time
            self._last = (name, dequantize_mxfp4(self.reader.get(name + BLOCKS),
                                                 self.reader.get(name + SCALES), self.dtype_)
                          if name in self.quantized else self.reader.get(name))
        return self._last[1]
