"""The rows a rank trains on, from the driver's rollout batch to the model's micro-batches: the
batch (TrainBatch: padded or packed) and its mini-batches, the share of each data-parallel rank
balanced by work, the transfer of each rank's own rows over the backend, the micro-batches filled up
to a token budget, padded or packed."""
