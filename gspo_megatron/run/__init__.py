"""One trainer rank's lifecycle, around the loop of trainer.py:

    preflight.py   every check before anything is spent (before torch, then with it)
    model_checks.py  the checks that read the models: teacher, prompts against the context, CPU serving
    setup.py       the Run: actor, driver (rank 0), weight sync, metrics; begin_rl, teardown
    model_files.py the run's derived model files: initial conversion, KL reference, HF export
    folders.py     the folders a run writes, their locks, the scratch directory
    recovery.py    no server left: save, wait, resync, redo the step's rollout
    signals.py     SIGTERM / SIGUSR1: save at the next safe point, exit 128 + signal
    metrics.py     TensorBoard + metrics.jsonl; loop_metrics.py: a step's scalars
    expected_warnings.py   the warnings a run silences (CPU without TE / apex), in one place

May import: config, driver, actor, sync, checkpoint, parallel, algorithms, model_specs, rollout;
never trainer or cli. The error base class, GspoError, is the package root's (gspo_megatron).
"""
