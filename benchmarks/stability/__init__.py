"""The parts of benchmarks/moe_stability.py: its regimes and arms (regimes.py), the report of a set
of runs (report.py: tables, the collapse and learning rules, figures), and the importance-ratio
probe that does not need the routing to move (ratios.py). The script itself starts the server,
makes the tasks, models and warm starts, and runs the arms."""
