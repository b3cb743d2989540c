"""What runs inside the SGLang server process, not in the trainer: the project's weight loader
(SGLang's `--custom-weight-loader` hook: full and delta updates, checksums) with its placement
probe, the routes of requests SGLang retracts kept for their responses (released_routes.py,
installed at start-up by startup/ on every server that returns routes), and the stand-ins for
CUDA-only packages that a CPU server needs (cpu_stand_ins/).

Nothing here is imported eagerly by this package: SGLang imports the loader by its dotted name, and
a server finds the start-up patches and the stand-ins through PYTHONPATH."""
