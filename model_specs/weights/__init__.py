"""HF <-> megatron-core weights: the map of one model's parameters (maps), the fused tensor
layouts it converts through (layouts), and batches of bounded size that keep together what must
be converted together (batches)."""
