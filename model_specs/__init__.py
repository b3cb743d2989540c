"""model_specs."""
