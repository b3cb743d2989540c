"""Stand-ins for CUDA/AMX-only packages, used ONLY by SGLang server child processes on CPU.

`sgl_kernel/` is a test double for SGLang's kernel package, which has no build for CPUs without
Intel AMX/AVX-512 (docs/cpu.md): `SGLANG_USE_CPU_ENGINE=1` makes SGLang import it at module level,
but on such hosts SGLang takes its torch-native paths and never calls a kernel. Every attribute is a
function raising NotImplementedError naming the op, so a call that does happen fails loudly.
`sitecustomize.py` replaces two Triton kernels of SGLang's Qwen2-MoE shared-expert gate (Triton
has no CPU backend) with the same math in torch, makes the CUDA-only pinning of the
routed-experts host buffer (--enable-return-routed-experts) a no-op, and sends DeepSeek-V3's
multi-latent attention on the torch_native backend to its absorbed path, when SGLang imports them.
`gdn_ops.py` has Qwen3-Next's Gated DeltaNet ops in torch (sgl_kernel.mamba and two torch.ops.sgl_kernel
entries; sitecustomize adds the glue that model needs on CPU).
`rollout.servers.launch` puts this directory on the child's PYTHONPATH; nothing in this project imports it.
"""
from pathlib import Path

STAND_INS_DIR = Path(__file__).resolve().parent
