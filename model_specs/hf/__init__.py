"""The Hugging Face side: reading config.json (config), the tensor shapes a config implies (tensors),
and the HF configs the project ships: published models' (published) and the tests' tiny ones
(tiny). Torch-free: the planner and the command line's early checks read them before torch."""
