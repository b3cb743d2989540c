"""Parallelism: the layout and its checks (layout.py), process groups and megatron's parallel state
(process_groups.py), where communication tensors live (comm.py), context parallelism's split
(context.py), the CPU/gloo adaptations of megatron-core (cpu_compat.py), a rank's model chunks
(model_chunks.py), and calls made on rank 0 whose result every rank gets (rank_zero.py).

May import: megatron-core and torch; of gspo_megatron only its root (GspoError). layout.py stays
torch-free: the run config and the first checks read it before torch is imported.
"""
