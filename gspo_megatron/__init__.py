"""gspo-megatron: GSPO training backend for MoE LLMs on megatron-core, with SGLang rollouts."""
__version__ = "0.1.0"
