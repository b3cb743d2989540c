"""gspo-megatron: GSPO training backend for MoE LLMs on megatron-core, with SGLang rollouts.

GspoError is the one error base class: a failure the run explains in one line.

    raise ConfigError(f"train.lr={lr!r}: expected >= 0")   # ConfigError is a GspoError
    ...
    except GspoError as e:                                 # cli.main, once
        print(f"gspo-megatron: error: {e}"); return e.exit_code

Every error the user can act on derives from it: a bad config, prompt set, model directory,
checkpoint or environment, a server that cannot start or answer, a reward that cannot run, no
server left. Its message is the whole line the user sees (what was wrong, the value, what was
expected); `exit_code` is 2 unless the error says otherwise (75: no server left, retryable).
Anything else that escapes a run is a bug and keeps its traceback. Where it replaces a builtin
(ValueError, RuntimeError, FileNotFoundError) a class derives from that too, so callers that catch
the builtin keep working. rollout/ and model_specs/ derive their errors from it and import nothing
else of gspo_megatron (tools/check_imports.py).
"""
__version__ = "0.1.0"

from model_specs import lazy_compile as _lazy_compile

_lazy_compile.install()  # before anything imports megatron-core (model_specs/lazy_compile.py)


class GspoError(Exception):
    """A failure explained in one line (the message); the process exits with `exit_code`."""

    exit_code: int = 2


class MissingInputError(GspoError, FileNotFoundError):
    """A file or directory the run needs is not there (the message names the field and path)."""
