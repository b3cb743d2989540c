"""The adapters in Hugging Face PEFT's format with SGLang's names, both ways.

    tensors = to_peft(adapters_full, wmap)            # {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": ...}
    config = peft_config(settings, tensors)            # adapter_config.json
    save_peft(folder, tensors, config)                 # adapter_model.safetensors + adapter_config.json
    adapters_full = from_peft(*load_peft(folder), wmap, settings)

`adapters_full` is the one-process adapter dict (merge.py lists its names). An adapter's B rows
go through the weight map exactly as its base weight's rows do (model_specs/weights/maps.py
WeightMap.to_hf: a fused linear_qkv's rows split into q, k, v; a gated fc1's into gate and up),
and its A, which multiplies the layer's input, is the same for each of those parts: one adapter
on megatron's fused linear_qkv is three PEFT adapters with one A. SGLang stacks them back
(sglang/srt/lora/lora.py LoRAAdapter.normalize_qkv_proj, normalize_gate_up_proj). An adapter made
elsewhere with a different A per part has no equal here, and importing it is refused.

Routed experts: per_expert as PEFT's per-module tensors (`mlp.experts.{e}.gate_proj.lora_A.weight`
[r, h]); shared_outer as SGLang's 3D tensors without an expert index
(`mlp.experts.gate_proj.lora_A.weight` [1, r, h], `...lora_B.weight` [E, ffn, r],
`down_proj.lora_A` [E, r, ffn], `down_proj.lora_B` [1, h, r]: mem_pool.py's
experts_shared_outer_loras layout).
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from gspo_errors import InputError
from gspo_megatron.lora.adapters import ADAPTER
from gspo_megatron.lora.lora_settings import LoraSettings
from model_specs.weights.maps import ParamMapping, WeightMap

PREFIX = "base_model.model."
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_LINEAR = re.compile(rf"^(.*)\.{ADAPTER}\.a$")
_EXPERTS = re.compile(rf"^(decoder\.layers\.(\d+)\.mlp\.experts)\.{ADAPTER}\.(fc[12])_a$")


class PeftError(InputError, ValueError):
    """A PEFT adapter that does not fit this model or these LoRA settings (the message names the
    file or tensor and what was expected)."""


def _module(hf_weight: str) -> str:
    return hf_weight.removesuffix(".weight")


def _mapping(wmap_by_name: Mapping[str, ParamMapping], weight: str) -> ParamMapping:
    m = wmap_by_name.get(weight)
    if m is None:
        raise PeftError(f"{weight}: the model's weight map has no such weight (an adapter on a "
                        "layer the HF format does not name)")
    if m.stacked:
        raise PeftError(f"{weight}: the HF format stacks every expert in one tensor ({m.hf[0]}); "
                        "adapters on such experts have no PEFT or SGLang form: lora.experts=none")
    return m


def _unshared(name: str) -> str:
    """An expert's HF module name without its expert index (SGLang's shared-outer key)."""
    return re.sub(r"\.experts\.\d+\.", ".experts.", name)


_FUSED = {("q_proj", "k_proj", "v_proj"): "qkv_proj", ("gate_proj", "up_proj"): "gate_up_proj"}
"""SGLang's stacked modules: an adapter on one of them has one A for every part and B's rows
stacked in the parts' order (sglang/srt/lora/lora.py normalize_qkv_proj, normalize_gate_up_proj
repeat such an A for each part)."""


def _parts(hf: Sequence[str], parts: Sequence[torch.Tensor], fused: bool) -> list[tuple[str, torch.Tensor]]:
    """(HF module, its B rows) of one weight's HF tensors; fused: SGLang's stacked module, one entry."""
    modules = [_module(h) for h in hf]
    stacked = _FUSED.get(tuple(m.rpartition(".")[2] for m in modules))
    if fused and stacked is not None:
        return [(f"{modules[0].rpartition('.')[0]}.{stacked}", torch.cat(list(parts), dim=-2))]
    return list(zip(modules, parts))


def to_peft(adapters: Mapping[str, torch.Tensor], wmap: WeightMap, *, fused: bool = False) -> dict[str, torch.Tensor]:
    """The PEFT tensors (module docstring) of one-process adapter tensors. fused: q/k/v and
    gate/up as SGLang's stacked modules (qkv_proj, gate_up_proj) with their A once, what the
    weight sync sends (no A repeated per part); PEFT's own names otherwise."""
    by_name = wmap.by_megatron_name()
    out: dict[str, torch.Tensor] = {}
    for name, a in adapters.items():
        m = _EXPERTS.match(name)
        if m:
            prefix, _, which = m.groups()
            b = adapters[f"{prefix}.{ADAPTER}.{which}_b"]
            rows = []  # per expert: (HF module, its A, its B part) for each HF tensor of the weight
            for e in range(max(a.shape[0], b.shape[0])):
                mp = _mapping(by_name, f"{prefix}.local_experts.{e}.linear_{which}.weight")
                parts = wmap.to_hf(mp, b[e if b.shape[0] > 1 else 0])
                rows.append([(module, a[e if a.shape[0] > 1 else 0], p) for module, p in _parts(mp.hf, parts, fused)])
            if a.shape[0] == b.shape[0]:  # per expert
                for row in rows:
                    for module, av, bv in row:
                        out[f"{PREFIX}{module}.lora_A.weight"] = av.clone()
                        out[f"{PREFIX}{module}.lora_B.weight"] = bv.contiguous()
                continue
            for j in range(len(rows[0])):  # shared_outer: 3D, no expert index
                module = _unshared(rows[0][j][0])
                av, bv = torch.stack([r[j][1] for r in rows]), torch.stack([r[j][2] for r in rows])
                out[f"{PREFIX}{module}.lora_A.weight"] = (av[:1] if a.shape[0] == 1 else av).contiguous()
                out[f"{PREFIX}{module}.lora_B.weight"] = (bv[:1] if b.shape[0] == 1 else bv).contiguous()
            continue
        m = _LINEAR.match(name)
        if m:
            mp = _mapping(by_name, f"{m.group(1)}.weight")
            for module, part in _parts(mp.hf, wmap.to_hf(mp, adapters[f"{m.group(1)}.{ADAPTER}.b"]), fused):
                out[f"{PREFIX}{module}.lora_A.weight"] = a.clone()
                out[f"{PREFIX}{module}.lora_B.weight"] = part.contiguous()
    return dict(sorted(out.items()))


def target_modules(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """The HF module short names the tensors adapt (q_proj, ..., down_proj)."""
    return sorted({k.removesuffix(".lora_A.weight").rpartition(".")[2] for k in tensors
                   if k.endswith(".lora_A.weight")})


def peft_config(settings: LoraSettings, tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """adapter_config.json: what PEFT and SGLang's LoRAConfig read (peft_type, r, lora_alpha,
    target_modules), and the expert layout for a fresh run's import."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": settings.rank,
            "lora_alpha": settings.alpha if settings.alpha is not None else settings.rank,
            "target_modules": target_modules(tensors), "bias": "none", "lora_dropout": 0.0,
            "gspo_experts": settings.experts}


def save_peft(folder: str | Path, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any]) -> Path:
    from safetensors.torch import save_file
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / WEIGHTS_FILE),
              metadata={"format": "pt"})
    (folder / CONFIG_FILE).write_text(json.dumps(dict(config), indent=2) + "\n")
    return folder


def load_peft(folder: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, adapter_config) of a PEFT folder; PeftError naming a missing or unreadable file."""
    from safetensors.torch import load_file
    folder = Path(folder)
    for f in (CONFIG_FILE, WEIGHTS_FILE):
        if not (folder / f).is_file():
            raise PeftError(f"{folder}: no {f} (expected a PEFT adapter folder: {CONFIG_FILE} and "
                            f"{WEIGHTS_FILE})")
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
        tensors = load_file(str(folder / WEIGHTS_FILE))
    except (OSError, ValueError) as e:
        raise PeftError(f"{folder}: cannot read the adapter ({type(e).__name__}: {e})") from None
    return tensors, config


def _check_config(config: Mapping[str, Any], settings: LoraSettings, where: str) -> None:
    if str(config.get("peft_type", "")).upper() != "LORA":
        raise PeftError(f"{where}: peft_type={config.get('peft_type')!r}, expected LORA")
    alpha = settings.alpha if settings.alpha is not None else settings.rank
    if config.get("r") != settings.rank or float(config.get("lora_alpha", -1)) != float(alpha):
        raise PeftError(f"{where}: r={config.get('r')} lora_alpha={config.get('lora_alpha')}, but the "
                        f"run's lora.rank={settings.rank} lora.alpha={alpha}: set them alike")


def from_peft(tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any], wmap: WeightMap,
              expected: Mapping[str, torch.Tensor], settings: LoraSettings,
              where: str = "the adapter") -> dict[str, torch.Tensor]:
    """One-process adapter tensors, named and shaped like `expected` (the run's own adapters),
    from PEFT tensors: the inverse of to_peft. PeftError naming a tensor that is missing, has
    another shape, is left over, or whose parts' A differ (module docstring)."""
    _check_config(config, settings, where)
    by_name = wmap.by_megatron_name()
    used: set[str] = set()

    def take(key: str) -> torch.Tensor:
        if key not in tensors:
            other = _unshared(key) if _unshared(key) != key else key.replace(".experts.", ".experts.0.")
            hint = (f": its routed experts have the other layout than lora.experts={settings.experts}"
                    if other in tensors else "")
            raise PeftError(f"{where}: {key} is missing{hint}")
        used.add(key)
        return tensors[key]

    def one_a(keys: list[str]) -> torch.Tensor:
        values = [take(k) for k in keys]
        if any(not torch.equal(values[0], v) for v in values[1:]):
            raise PeftError(f"{where}: {keys[0]} and {keys[1]} differ: this project's adapters share "
                            "one A across the parts of a fused layer (q/k/v, gate/up), so an adapter "
                            "with an A of its own per part cannot be imported")
        return values[0]

    out: dict[str, torch.Tensor] = {}
    for name, want in expected.items():
        m = _EXPERTS.match(name)
        if m:
            prefix, _, which = m.groups()
            b_want = expected[f"{prefix}.{ADAPTER}.{which}_b"]
            experts = max(want.shape[0], b_want.shape[0])
            maps = [_mapping(by_name, f"{prefix}.local_experts.{e}.linear_{which}.weight")
                    for e in range(experts)]
            if want.shape[0] == b_want.shape[0]:  # per expert
                a = torch.stack([one_a([f"{PREFIX}{_module(h)}.lora_A.weight" for h in mp.hf]) for mp in maps])
                b = torch.stack([wmap.to_megatron(mp, [take(f"{PREFIX}{_module(h)}.lora_B.weight")
                                                       for h in mp.hf]) for mp in maps])
            else:  # shared_outer
                shared = [_unshared(_module(h)) for h in maps[0].hf]
                a = one_a([f"{PREFIX}{s}.lora_A.weight" for s in shared])
                b_parts = [take(f"{PREFIX}{s}.lora_B.weight") for s in shared]
                b = torch.stack([wmap.to_megatron(mp, [p[e if p.shape[0] > 1 else 0] for p in b_parts])
                                 for e, mp in enumerate(maps)])
                b = b[:1] if b_want.shape[0] == 1 else b
            out[name], out[f"{prefix}.{ADAPTER}.{which}_b"] = a, b
            continue
        m = _LINEAR.match(name)
        if m:
            mp = _mapping(by_name, f"{m.group(1)}.weight")
            out[name] = one_a([f"{PREFIX}{_module(h)}.lora_A.weight" for h in mp.hf])
            out[f"{m.group(1)}.{ADAPTER}.b"] = wmap.to_megatron(
                mp, [take(f"{PREFIX}{_module(h)}.lora_B.weight") for h in mp.hf])
    for name, want in expected.items():
        got = out.get(name)
        if got is None or tuple(got.shape) != tuple(want.shape):
            raise PeftError(f"{where}: {name} has shape {None if got is None else tuple(got.shape)}, "
                            f"the run's adapter {tuple(want.shape)} (another model, rank or "
                            "lora.experts layout)")
    left = sorted(set(tensors) - used)
    if left:
        raise PeftError(f"{where}: {len(left)} tensors adapt layers this run does not ({left[0]}, ...): "
                        "set lora.targets and lora.experts as the adapter was trained")
    return {k: out[k].to(expected[k].dtype) for k in expected}
