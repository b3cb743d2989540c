"""The Actor's weights as the rest of the library sees them: `full.py`, one-process (TP1/PP1/EP1)
state dicts gathered from and loaded into any layout; `adapter_state.py`, the same for a LoRA run's
adapters; `weight_io.py`, the Actor's verbs over both and over its training checkpoints."""
