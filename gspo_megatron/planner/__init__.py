"""Layout planner: which TP/PP/EP/CP layout and token budget fit a model on a cluster (cli `plan`):
the memory model (memory.py), the weight-sync time (sync_time.py), the search over layouts
(plan.py), the command (command.py, arguments.py), and `--check`, which runs one step of a layout
to compare the prediction (check.py).

May import: config (a run's config to plan for), actor (check.py builds one), parallel,
model_specs (published configs, shapes), run (expected_warnings); never driver, trainer or cli.
"""
