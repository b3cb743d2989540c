"""The model families: each a list of features (features/), declared in one module of this package
with the architecture it describes (qwen.py: Qwen2, Qwen2-MoE, Qwen3, Qwen3-MoE, Qwen3-Next; ...).

    family = family_for(hf)                            # FAMILIES["qwen3_moe"], a Family
    family.all_features                        # (Decoder(), GQA(), QKNorm(), Rope(), MoE(), ...)
    tiny = FAMILIES["qwen3_moe"].tiny_hf_config(num_hidden_layers=6)   # the tests' tiny config

Every module here that declares `FAMILIES = (Family(...), ...)` is read at import, in name order,
into the table FAMILIES; a family from outside the package is registered by a `plugins:` module
(`FAMILIES.register(Family(...))`, docs/extending.md has the recipe). Torch-free, so that the
planner and the command line's early checks tell a model's family without torch; build.py maps
a family to megatron (model_spec_for), shape.py to its torch-free shape, weights/maps.py to its
weight map.
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from gspo_tables import Table, TableError
from model_specs.features import Feature
from model_specs.features.decoder import Decoder
from model_specs.hf.config import HFConfigError


@dataclass(frozen=True)
class Family:
    """One decoder family: the HF model_types it reads, its features, the tests' tiny config."""

    name: str
    """The family's name (FAMILIES key)."""
    model_types: tuple[str, ...]
    """HF `model_type` values of the family."""
    features: tuple[Feature, ...]
    """What it adds to the decoder (features/decoder.py), in order: a feature that restricts
    others' weight rules (MoE, GatedDeltaNet) comes after the ones it restricts."""
    tiny: Callable[..., dict[str, Any]] | None = None
    """Its tiny HF config for tests (hf/tiny.py), overrides as keyword arguments; None where the
    tests need none (qwen2, llama: they reuse tiny Qwen3 with another model_type)."""

    @property
    def all_features(self) -> tuple[Feature, ...]:
        """The decoder, then the family's features."""
        return (Decoder(), *self.features)

    @property
    def moe(self) -> bool:
        """It has routed-expert layers."""
        return any(f.moe for f in self.features)

    def tiny_hf_config(self, **overrides: Any) -> dict[str, Any]:
        """The tests' tiny HF config of this family, with `overrides` applied."""
        if self.tiny is None:
            raise LookupError(f"family {self.name!r} has no tiny config; families with one: "
                              f"{[n for n, f in FAMILIES.items() if f.tiny]}")
        return self.tiny(**overrides)


def _describe(family: Family) -> str:
    features = ", ".join(type(feature).__name__ for feature in family.features)
    return f"model_type {' or '.join(family.model_types)}" + (f" ({features})" if features else "")


class FamilyTable(Table[Family]):
    """The families by name; a model_type belongs to one family only."""

    def register(self, row: Family) -> Family:
        taken = {m for f in self.values() if f is not row for m in f.model_types} & set(row.model_types)
        if taken:
            raise TableError(f"family {row.name!r}: model_type(s) {sorted(taken)} belong to another family already")
        return super().register(row)


FAMILIES: FamilyTable = FamilyTable("model family", Family, description_of=_describe,
                                     field="model.hf_path (its config.json's model_type)")


def _declare_shipped() -> None:
    """Every Family of this package's modules (module docstring), refusing a name or model_type
    declared twice."""
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        for family in getattr(module, "FAMILIES", ()):
            FAMILIES.register(family)


_declare_shipped()


def family_for(hf_config: Mapping[str, Any]) -> Family:
    """The family of a normalised HF config; an unknown model_type is refused by name."""
    model_type = hf_config.get("model_type")
    for family in FAMILIES.values():
        if model_type in family.model_types:
            return family
    known = sorted(m for f in FAMILIES.values() for m in f.model_types)
    raise HFConfigError(f"unknown architecture: model_type={model_type!r} "
                        f"(architectures={hf_config.get('architectures')}) is not a supported "
                        f"family; supported: {known} (a family of your own: docs/extending.md)")
