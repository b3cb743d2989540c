"""The error base of the project: the one class whose message is the line the user sees.

    raise ConfigError(f"train.lr={lr!r}: expected >= 0")   # ConfigError is a GspoError
    ...
    except GspoError as e:                                 # gspo_megatron.cli.main, once
        print(f"gspo-megatron: error: {e}"); return e.exit_code   # 2 inputs, 3 runtime, 75

Every error the user can act on derives from it: a bad config, prompt set, model directory,
checkpoint or environment, a server that cannot start or answer, a reward that cannot run, no
server left. Its message is the whole line the user sees (what was wrong, the value, what was
expected). `exit_code` tells the two kinds apart, so that a script or a scheduler can: 2
(EXIT_INPUT) for the inputs (an InputError wherever it is raised, and anything the start-up checks
of gspo_megatron/run/preflight.py refuse: fix the config or a file), 3 (EXIT_RUNTIME) for a run
that stopped on a failure of its own parts once the checks had passed (a weight sync, a server, the
reward error budget); 75 when no server is left (retryable). A signal exits 128 + its number (not an
error). Anything else that escapes a run is a bug and keeps its traceback. Where it replaces a
builtin (ValueError, RuntimeError, FileNotFoundError) a class derives from that too, so callers
that catch the builtin keep working.

The bottom of the house: it imports nothing, and every package (gspo_megatron, rollout,
model_specs, tools) imports it downward (tools/check_imports.py).
"""
EXIT_INPUT = 2
"""The inputs are wrong (config, paths, files, layout): nothing was spent, the same command fails
again until they are fixed."""
EXIT_RUNTIME = 3
"""The run stopped on a failure of its own parts after the start-up checks passed (a server, the
weight sync, the rewards): the last checkpoint resumes it once the cause is gone."""


class GspoError(Exception):
    """A failure explained in one line (the message); the process exits with `exit_code`."""

    exit_code: int = EXIT_RUNTIME


class InputError(GspoError):
    """A failure of the inputs (the message names the field or file): exit 2 wherever it is raised."""

    exit_code = EXIT_INPUT


class MissingInputError(InputError, FileNotFoundError):
    """A file or directory the run needs is not there (the message names the field and path)."""
