"""Advantages: the estimators (a table, like LOSSES), reward shaping and the advantage's own
clipping and whitening. docs/algorithm.md "Advantage estimators" has the formulas and the peers'
names for each.

    table.py      ESTIMATORS and AdvantageSettings (the loss section's advantage fields; no torch)
    estimators.py group statistics, each estimator's baseline and scale, returns-to-go
    shaping.py    ROLL's reward normalisation (batch, group, running) and clip, whitening, clip
    pipeline.py   rewards -> advantages of a batch, on the driver or, with the KL in the reward, on
                  the last pipeline stage of every data-parallel rank (one set of statistics)

May import: torch, the rest of gspo_megatron.algorithms.
"""
