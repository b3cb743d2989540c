"""What a sender puts on the wire for each server: the whole tensor (a full sync), or only the
elements that changed since the version the server holds (a delta sync), in the dtype the server
serves, in rollout/in_server/weight_loader.py's payload format.

    enc = DeltaEncoder(torch.bfloat16)                 # one per sender, kept across syncs
    parts = enc.encode(bucket, delta=True, check=...)  # {"full": payload, "delta": payload}
    enc.stats                                          # elements, changed, checked

The sender keeps the last values it sent of its own HF tensors (`base`, in the served dtype, on
the host: model bytes in the served dtype / number of senders per sender; docs/sync.md gives the
figures at Qwen3-30B-A3B's and Qwen3-235B-A22B's shapes) and compares bit patterns on the
tensor's device (the base copied there per tensor; what goes on the wire stays there for a sender
that hands GPU memory to the servers, `on_device`), so an update
below the served dtype's resolution sends nothing, and -0.0 / NaN payloads compare exactly. Per
tensor the cheapest of three forms goes: the changed values with their flat indices (int32, or
int64 past 2**31 elements), the changed values with a bitmask of the changed elements (1 bit per
element: cheaper once more than 1 in 32 changed), or the whole tensor (in bf16, once more than
about 15/16 changed). `base` describes the servers only after a sync that
succeeded everywhere: WeightSync sends a full sync after any failure (invalidate()).
"""
from __future__ import annotations

from typing import Sequence

import torch

from rollout.in_server.weight_loader import PART, bit_pattern, checksum, pack_bits


class DeltaEncoder:
    def __init__(self, served_dtype: torch.dtype, keep_base: bool = True) -> None:
        self.dtype, self.keep_base = served_dtype, keep_base
        self.on_device = False
        """The payload stays on the tensors' device (a sender that hands GPU memory to the servers:
        the tensor transport's cuda_ipc); else it goes to the host. `base` is on the host either way."""
        self.base: dict[str, torch.Tensor] = {}
        self.reset_stats()

    def reset_stats(self) -> None:
        self.stats = {"elements": 0, "changed": 0, "checked": 0}

    def invalidate(self) -> None:
        """The servers may not hold `base` any more: the next encode must be full everywhere."""
        self.base.clear()

    def encode(self, bucket: Sequence[tuple[str, torch.Tensor]], *, delta: bool, full: bool,
               check: Sequence[str] = ()) -> dict[str, list[tuple[str, torch.Tensor]]]:
        """The payloads of one bucket: "full" (every tensor whole) if `full`, "delta" (changed
        elements since `base`) if `delta`; `check`: names whose checksum a delta server verifies.
        Updates `base` to the bucket's values (call once per bucket and sync)."""
        out: dict[str, list[tuple[str, torch.Tensor]]] = {}
        if full:
            out["full"] = []
        if delta:
            out["delta"] = []
        checked = set(check)
        for name, tensor in bucket:
            # compared where the tensor is (a GPU's cores, not the host's); what goes on the wire
            # and into `base` is on the host
            here = tensor.detach().to(dtype=self.dtype).contiguous()
            new = here if here.device.type == "cpu" else here.cpu()
            wire = here if self.on_device else new
            shape = torch.tensor(list(new.shape), dtype=torch.int64)
            extra = []
            if delta and name in checked:  # exact on any device (weight_delta.checksum)
                extra = [(name + PART + "shape", shape), (name + PART + "sum", torch.tensor([checksum(here)]))]
                self.stats["checked"] += 1
            nbytes = new.numel() * new.element_size()
            self.stats["elements"] += new.numel()
            if full:  # SGLang's own load: checked where deltas are (they bypass it)
                out["full"] += [(name, wire)]
            if delta:
                old = self.base.get(name)
                if old is None or old.shape != new.shape:
                    raise KeyError(f"no base for {name} {tuple(new.shape)}: a delta needs a full "
                                   "sync of this sender first")
                mask = bit_pattern(here) != bit_pattern(old.to(here.device, non_blocking=True))
                changed = mask.nonzero().reshape(-1)
                self.stats["changed"] += changed.numel()
                idx_dtype = torch.int32 if new.numel() < (1 << 31) else torch.int64
                values = changed.numel() * new.element_size()
                as_idx = changed.numel() * idx_dtype.itemsize
                as_bits = (new.numel() + 7) // 8
                if values + min(as_idx, as_bits) >= nbytes:
                    out["delta"] += [(name, wire)] + extra
                elif changed.numel():
                    where = ((PART + "idx", changed.to(idx_dtype)) if as_idx <= as_bits
                             else (PART + "bits", pack_bits(mask)))
                    to_wire = (lambda t: t) if self.on_device else (lambda t: t.cpu())
                    out["delta"] += [(name + where[0], to_wire(where[1])),
                                     (name + PART + "val", to_wire(here.reshape(-1)[changed]))]
                    out["delta"] += extra or [(name + PART + "shape", shape)]
                elif extra:
                    out["delta"] += extra
            if self.keep_base:
                self.base[name] = new
        return out
