"""Rank 0's side of the loop (the driver): SGLang servers, prompts, rollouts and rewards, turned
into the step's packed TrainBatch.

    driver.py            Driver: servers, rollout manager, rewards, the step's batch, state
    servers.py           start or attach the policy's and the teacher's SGLang servers
    samples_to_batch.py  samples -> TrainBatch (packed), the warm start's rows
    rollout_metrics.py   rollout/*, reward/*, distill/* scalars of a batch
    staleness.py         asynchronous rollouts: which finished groups are fresh enough
    evaluation.py        the held-out eval (eval: section)
    environment.py       multi-turn: the environment named by the config
    turn_credit.py       multi-turn: per-turn rewards -> per-token advantages
    warm_start.py        the supervised warm start's examples (answers, scripted episodes)
    records.py           rollout records: one JSON line per sample

May import: config, actor (TrainBatch only), algorithms, parallel, model_specs (configs),
rollout; never run, trainer or cli (run/setup.py builds the driver).
"""
