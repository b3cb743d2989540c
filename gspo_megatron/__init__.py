"""gspo-megatron: GSPO training backend for MoE LLMs on megatron-core, with SGLang rollouts."""
__version__ = "0.1.0"

from model_specs import lazy_compile as _lazy_compile

_lazy_compile.install()  # before anything imports megatron-core (model_specs/lazy_compile.py)
