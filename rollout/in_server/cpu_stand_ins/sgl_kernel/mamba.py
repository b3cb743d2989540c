"""`sgl_kernel.mamba` for Qwen3-Next's Gated DeltaNet on CPU: SGLang imports it only on CPU
(layers/attention/linear/gdn_backend.py and kernels/gdn_triton.py, the `elif is_cpu():` branches),
then looks up two `torch.ops.sgl_kernel.*_cpu` ops. Both come from ../gdn_ops.py (torch, same math)."""
from gdn_ops import (causal_conv1d_fn_cpu, causal_conv1d_update_cpu,  # noqa: F401
                     chunk_gated_delta_rule_cpu, install_torch_ops)

install_torch_ops()
