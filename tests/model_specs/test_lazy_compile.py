"""model_specs/lazy_compile.py: without CUDA, importing megatron-core imports neither TorchDynamo nor
Inductor, torch.compile is torch's own again afterwards, and a deferred function compiles (with
its options) on its first call only."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_megatron_imports_without_dynamo_and_leaves_torch_compile_alone():
    code = ("import sys, torch; real = torch.compile\n"
            "from gspo_megatron.actor import Actor\n"
            "from megatron.core.fusions import fused_bias_geglu, fused_bias_swiglu\n"
            "from megatron.core.optimizer import get_megatron_optimizer\n"
            "from megatron.core.distributed import DistributedDataParallel\n"
            "assert torch.compile is real, torch.compile\n"
            "bad = [m for m in sys.modules if m.startswith(('torch._dynamo', 'torch._inductor'))]\n"
            "assert not bad, bad[:5]\n"
            "assert fused_bias_swiglu.bias_swiglu.__name__ == 'bias_swiglu'\n")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_a_deferred_function_compiles_once_on_first_call_with_its_options():
    from model_specs.lazy_compile import deferred_compile
    calls = []

    def real(fn, **kwargs):
        calls.append(kwargs)
        return lambda *a, **k: ("compiled", fn(*a, **k))

    compile_later = deferred_compile(real)

    @compile_later
    def add(a, b=1):
        return a + b

    @compile_later(dynamic=True)
    def twice(a):
        return 2 * a

    assert calls == [] and add.__name__ == "add"
    assert add(1, b=2) == ("compiled", 3) and add(5) == ("compiled", 6)
    assert twice(4) == ("compiled", 8)
    assert calls == [{}, {"dynamic": True}]
