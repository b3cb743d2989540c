"""Each CPU/gloo adaptation of megatron-core (gspo_megatron/parallel/cpu_compat.py) is tested twice:
with every adaptation applied, the megatron-core code path works and gives the right numbers; with
all but this one applied (a fresh process), it still fails the way docs/cpu.md records. If a
megatron-core upgrade fixes the problem, the second test fails: drop the adaptation then.
"""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from distributed import run_distributed

ROOT = Path(__file__).resolve().parents[2]


def run_snippet(code: str, skip: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    prelude = (f"from gspo_megatron.parallel import cpu_compat\n"
               f"cpu_compat.apply(skip={set(skip)!r} or frozenset())\n")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=180)


RNG_CODE = """
import torch
from megatron.core.tensor_parallel import get_cuda_rng_tracker, model_parallel_cuda_manual_seed
model_parallel_cuda_manual_seed(42, tp_rank=1, ep_rank=0, etp_rank=0)
with get_cuda_rng_tracker().fork():          # the tensor-parallel stream: seed + 2718 + tp_rank
    inside = torch.rand(3)
after = torch.rand(3)                        # the default (data-parallel) stream: seed
ref_tp = torch.rand(3, generator=torch.Generator().manual_seed(42 + 2718 + 1))
ref_dp = torch.rand(3, generator=torch.Generator().manual_seed(42))
assert torch.equal(inside, ref_tp), (inside, ref_tp)
assert torch.equal(after, ref_dp), (after, ref_dp)
print("RNG-OK")
"""


@pytest.mark.slow
def test_rng_tracker_runs_on_cpu_generator_with_megatron_seeds():
    out = run_snippet(RNG_CODE)
    assert out.returncode == 0 and "RNG-OK" in out.stdout, out.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("skip", ["torch_cuda", "megatron_rng"])
def test_rng_adaptation_still_needed(skip):
    out = run_snippet(RNG_CODE, skip=(skip,))
    assert out.returncode != 0, f"megatron RNG now works without '{skip}': drop that adaptation"


DEVICE_CODE = """
import torch
from megatron.core.transformer.utils import get_default_causal_mask
mask = get_default_causal_mask(4)            # transformer/utils.py: torch.ones(..., device="cuda")
assert mask.device.type == "cpu" and mask.shape == (4, 4) and mask[0, 1] and not mask[1, 0]
assert torch.zeros(2).type() == "torch.cuda.FloatTensor"          # optimizer.py type checks
assert torch.zeros(2).type(torch.float64).dtype == torch.float64  # conversions still convert
assert torch.zeros(2).to(0).device.type == "cpu"                  # .to(<cuda ordinal>)
print("DEVICE-OK")
"""


@pytest.mark.slow
def test_device_mode_maps_cuda_literals_and_type_checks():
    out = run_snippet(DEVICE_CODE)
    assert out.returncode == 0 and "DEVICE-OK" in out.stdout, out.stderr[-3000:]


@pytest.mark.slow
def test_device_mode_still_needed():
    out = run_snippet(DEVICE_CODE, skip=("device_mode",))
    assert out.returncode != 0, "megatron no longer hard-codes CUDA here: drop device_mode"


def test_megatron_still_compares_cuda_type_strings():
    """The optimizers reject a CPU float param unless type() answers the CUDA name."""
    import megatron.core.optimizer.optimizer as opt_mod

    source = Path(opt_mod.__file__).read_text()
    assert "param.type() == 'torch.cuda.FloatTensor'" in source


BACKWARD_CODE = """
import torch
from megatron.core.fusions import fused_softmax


class Recomputed(torch.autograd.Function):  # megatron's recomputation runs forward code in backward
    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, g):
        mask = fused_softmax.get_default_causal_mask(5)   # as forward_torch_softmax calls it
        assert mask.device.type == "cpu" and mask.shape == (5, 5) and mask[0, 1] and not mask[1, 0]
        return g


x = torch.ones(2, requires_grad=True)
Recomputed.apply(x).sum().backward()
print("BACKWARD-OK")
"""


@pytest.mark.slow
def test_causal_mask_built_in_backward():
    out = run_snippet(BACKWARD_CODE)
    assert out.returncode == 0 and "BACKWARD-OK" in out.stdout, out.stderr[-3000:]


@pytest.mark.slow
def test_causal_mask_in_backward_still_needed():
    out = run_snippet(BACKWARD_CODE, skip=("backward_device_literals",))
    assert out.returncode != 0, "megatron's causal mask no longer needs CUDA in backward: drop it"


MOE_CODE = """
import numpy as np, torch
from megatron.core.transformer.moe import moe_utils, token_dispatcher
assert moe_utils.te_general_gemm is None
splits = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([3, 1]), as_numpy=True)
assert isinstance(splits, np.ndarray) and splits.tolist() == [3, 1]
print("MOE-OK")
"""


@pytest.mark.slow
def test_moe_adaptations():
    out = run_snippet(MOE_CODE)
    assert out.returncode == 0 and "MOE-OK" in out.stdout, out.stderr[-3000:]


def test_moe_adaptations_still_needed():
    """Unpatched megatron: no te_general_gemm without TE (NameError in the router) and split sizes
    left as tensors for CPU inputs (TypeError in gloo's all_to_all_single)."""
    from megatron.core.transformer.moe import moe_utils

    assert not hasattr(moe_utils, "te_general_gemm") or moe_utils.te_general_gemm is None
    source = Path(moe_utils.__file__).read_text()
    assert "if te_general_gemm is not None" in source
    assert torch.is_tensor(moe_utils.maybe_move_tensor_to_cpu(torch.tensor([3, 1]), as_numpy=True))


def _gather_uneven(rank, world_size, patched):
    from gspo_megatron.parallel import cpu_compat

    gather = cpu_compat._all_gather_uneven if patched else cpu_compat._gloo_all_gather
    sizes = [3, 1]
    mine = torch.full((sizes[rank], 2), float(rank + 1))
    out = [torch.empty(n, 2) for n in sizes]
    gather(out, mine)
    return [t.tolist() for t in out]


@pytest.mark.slow
def test_uneven_all_gather_on_gloo():
    expected = [[[1.0, 1.0]] * 3, [[2.0, 2.0]]]
    assert run_distributed(_gather_uneven, 2, (True,)) == [expected, expected]


@pytest.mark.slow
def test_uneven_all_gather_still_needed():
    with pytest.raises(RuntimeError, match="rank . of 2 failed"):
        run_distributed(_gather_uneven, 2, (False,), timeout=60)


def test_vpp_forces_batch_p2p_comm_off():
    from gspo_megatron.parallel.cpu_compat import cpu_config_overrides

    assert cpu_config_overrides(2)["batch_p2p_comm"] is False
    assert cpu_config_overrides(2)["variable_seq_lengths"] is False
    assert "batch_p2p_comm" not in cpu_config_overrides(None)
