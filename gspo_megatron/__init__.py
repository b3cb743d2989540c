"""gspo-megatron: GSPO training backend for MoE LLMs on megatron-core, with SGLang rollouts.

The entry points are `gspo_megatron.cli` (the `gspo-megatron` command) and `gspo_megatron.trainer`
(the RL loop); the error base they catch is `gspo_errors.GspoError`, re-exported here for users.
"""
__version__ = "0.1.0"

from model_specs import lazy_compile as _lazy_compile
from gspo_errors import EXIT_INPUT, EXIT_RUNTIME, GspoError, InputError, MissingInputError  # noqa: F401

_lazy_compile.install()  # before anything imports megatron-core (model_specs/lazy_compile.py)
