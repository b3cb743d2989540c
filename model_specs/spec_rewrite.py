"""Rewriting a megatron-core layer spec tree: the one walk that the families' adaptations share
(norms.replace_local_norms, moe.use_expert_bias_router and use_expert_fc2, mla.adapt_mla_spec,
sinks.use_sink_attention).

    spec = rewrite_spec(spec, lambda s: Ours if s is Theirs else None)

A spec tree is ModuleSpecs (module + submodules), submodule dataclasses, lists of layer specs and,
in megatron-core 0.19, functools.partials of modules. `rewrite_spec` returns a copy in which every
node for which `replace(node)` is not None is that value (its children are not walked), leaving
the original tree, which megatron caches and shares between calls, untouched.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

from megatron.core.transformer.spec_utils import ModuleSpec


def rewrite_spec(spec: Any, replace: Callable[[Any], Any]) -> Any:
    """A copy of `spec` with the nodes `replace` returns something for replaced (module docstring)."""
    new = replace(spec)
    if new is not None:
        return new
    if isinstance(spec, list):
        return [rewrite_spec(s, replace) for s in spec]
    if isinstance(spec, ModuleSpec):
        return dataclasses.replace(spec, module=rewrite_spec(spec.module, replace),
                                   submodules=rewrite_spec(spec.submodules, replace))
    if isinstance(spec, functools.partial):
        return functools.partial(rewrite_spec(spec.func, replace), *spec.args,
                                 **{k: rewrite_spec(v, replace) for k, v in spec.keywords.items()})
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        return dataclasses.replace(spec, **{f.name: rewrite_spec(getattr(spec, f.name), replace)
                                            for f in dataclasses.fields(spec) if f.init})
    return spec
