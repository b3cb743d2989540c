"""Experts with biases on megatron's local spec (what the feature maps: __init__.py).

megatron's expert MLP adds its fc2 bias, times the token's routing weight, to fc2's output in
place (MLP.forward). With one expert-TP rank and no expert parallelism that output is what the TP
reduction over a group of one returned as it was (RowParallelLinear.forward, 0.16 and 0.19;
mappings.py, _ReduceFromModelParallelRegion), and autograd refuses the in-place add ("a view ...
is being modified inplace"): a one-process model with expert biases does not run.
`ExpertRowParallelLinear` takes the path megatron takes for experts under expert parallelism
instead (`explicit_expert_comm`: fc2's output as computed, no reduction), which over a group of
one is the same sum; `use_expert_fc2` puts it in the experts' spec.
It also unmarks the fc2 bias as sequence-parallel: megatron marks every row-parallel bias so
(RowParallelLinear.__init__) and, with sequence parallelism, sums the gradients of marked
parameters over the TP group (finalize_model_grads._allreduce_non_tensor_model_parallel_grads).
An expert's bias gradient is whole on the rank that holds the expert (its tokens come through
the dispatcher, and expert-DP replicas are reduced by DDP), so that sum added other ranks'
experts' gradients to it: under TP2 x EP2 the fc2 biases were 1.3e-3 off one process after one
GSPO step, the log-probs 1.4e-6.
And it marks that bias as split over its expert-TP group of one (expert-TP is 1 wherever experts
have biases: __init__.py refuses more): the MoE optimizer counts a parameter in the gradient norm
on the dense TP group's rank 0 only unless it is marked TP-split (get_main_grads_for_grad_norm;
optimizer/__init__.py _get_megatron_optimizer_based_on_param_groups hands it the dense TP group),
which left the other TP ranks' experts' fc2 biases out of the norm (1.3914 against 1.3932 under
TP2 x EP2), and out of gradient clipping.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from megatron.core.tensor_parallel.layers import (RowParallelLinear,
                                                  set_tensor_model_parallel_attributes)
from megatron.core.transformer.moe.moe_layer import MoESubmodules

from model_specs.spec_rewrite import rewrite_spec


class ExpertRowParallelLinear(RowParallelLinear):
    """megatron-core's RowParallelLinear for routed experts' fc2: over one expert-TP rank it skips
    the reduction over a group of one, as it does under expert parallelism, and its bias is not
    marked sequence-parallel (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.is_expert and self.tp_group.size() == 1:
            self.explicit_expert_comm = True
        if self.is_expert and self.bias is not None:
            self.bias.sequence_parallel = False  # its gradient is whole (module docstring)
            if self.tp_group.size() == 1:  # counted in the grad norm on every rank (docstring)
                set_tensor_model_parallel_attributes(self.bias, True, 0, 1)


def use_expert_fc2(spec: Any) -> Any:
    """A copy of a local block / layer spec whose routed experts' fc2 is ExpertRowParallelLinear
    (shared experts and dense MLPs keep theirs)."""
    def fc2(s: Any) -> Any:
        return ExpertRowParallelLinear if s is RowParallelLinear else None

    return rewrite_spec(spec, lambda s: dataclasses.replace(s, experts=rewrite_spec(s.experts, fc2))
                        if isinstance(s, MoESubmodules) else None)
