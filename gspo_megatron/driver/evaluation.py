"""Evaluation on a held-out prompt set during training (the `eval:` config section).

    evaluator = Evaluator(cfg, pool, tokenizer, decode, rewards=rewards)   # rank 0: the driver's parts
    metrics = evaluator.run(step=40)                # the servers' current weights

Before step 0, before every `eval.interval`-th step and after the last one, the driver samples
`eval.samples_per_prompt` responses per eval prompt (greedy by default: eval.temperature 0 is
top-k 1) on the live SGLang servers, with the weights of that moment, scores them with the run's
reward (or its environment) and reports:
    eval/accuracy         mean@n: the fraction of all responses that are correct (reward >= 1)
    eval/pass@k           the fraction of prompts with a correct response among their n (k = n)
    eval/reward_mean, eval/response_length, time/eval
and, for rows that have a `data_source`, eval/accuracy/<source> and eval/pass@k/<source>. Every
response can be appended to `logging.eval_records` (one JSON line each) to recount them by hand.
An eval's metrics are logged with the step they precede (the final one with step = train.steps),
so a resumed run that redoes a step redoes its eval and the record replaces the old one.
"""
from __future__ import annotations

import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from gspo_megatron.config import RunConfig
from gspo_megatron.driver.environment import reward_workers
from rollout.generation.multiturn.chat import ChatTemplate
from rollout.generation.multiturn import Environment
from rollout.prompts.dataset import chat_prompt_ids, load_prompts
from rollout.generation.manager import RolloutManager
from rollout.rewards import RewardErrorBudget, RewardWorkerPool
from rollout.generation.sample import Sample
from rollout.servers.pool import ServerPool

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def eval_due(cfg: RunConfig, step: int) -> bool:
    """An eval runs before `step` (0, every interval-th) when the eval section is on."""
    return bool(cfg.eval.interval and cfg.eval.prompts) and step % cfg.eval.interval == 0


def eval_metrics(groups: list[list[Sample]]) -> dict[str, float]:
    """The eval/* scalars of scored groups (one group per prompt)."""
    def summary(gs: list[list[Sample]], suffix: str = "") -> dict[str, float]:
        samples = [s for g in gs for s in g]
        return {f"eval/accuracy{suffix}": statistics.fmean(float(s.score >= 1.0) for s in samples),
                f"eval/pass@k{suffix}": statistics.fmean(float(any(s.score >= 1.0 for s in g)) for g in gs)}
    out = summary(groups)
    samples = [s for g in groups for s in g]
    out["eval/reward_mean"] = statistics.fmean(s.score for s in samples)
    out["eval/response_length"] = statistics.fmean(len(s.response_ids) for s in samples)
    sources = sorted({str(g[0].prompt["data_source"]) for g in groups if "data_source" in g[0].prompt})
    for source in sources:
        out.update(summary([g for g in groups if str(g[0].prompt.get("data_source")) == source], f"/{source}"))
    return out


class Evaluator:
    """Rank 0's evaluation: its own rollout manager over the driver's server pool."""

    def __init__(self, cfg: RunConfig, pool: ServerPool, tokenizer: PreTrainedTokenizerBase,
                 decode: Callable[[list[int]], str], *, rewards: RewardWorkerPool | None = None,
                 env_factory: Callable[[dict], Environment] | None = None, chat: ChatTemplate | None = None,
                 cache_dir: Path | None = None) -> None:
        """The driver's parts (driver.py): its server pool, tokenizer and decode; its reward
        workers (single-turn), or its environment and chat template (multi-turn). cache_dir: where
        parquet sets are memory-mapped from (rollout/prompts/sets.py)."""
        r, e = cfg.rollout, cfg.eval
        self.cfg = cfg
        self.prompts = load_prompts(e.prompts, e.prompt_key or r.prompt_key, e.answer_key or r.answer_key,
                                    cache_dir=cache_dir, prompt_format=r.prompt_format)
        greedy = e.temperature == 0
        config = dataclasses.replace(
            r, group_size=e.samples_per_prompt, temperature=1.0 if greedy else e.temperature,
            top_k=1 if greedy else -1, top_p=e.top_p, max_new_tokens=e.max_new_tokens or r.max_new_tokens,
            dynamic_sampling=False, oversample_groups=0, partial_rollouts=False, mask_stale_tokens=False,
            return_routed_experts=False, seed=None, max_reward_error_fraction=1.0)
        budget = RewardErrorBudget(1.0, what="the held-out eval")  # it never stops the run: said once
        self.own_rewards = None
        if env_factory is None and (e.reward or r.reward) != r.reward:
            self.own_rewards = reward_workers(cfg, e.reward, cfg.eval_reward_args())
        if env_factory is not None:
            self.manager = RolloutManager(pool, config, decode=decode, env_factory=env_factory, chat=chat,
                                          max_turns=r.max_turns, reward_budget=budget)
        else:
            self.manager = RolloutManager(pool, config, encode_prompt=lambda rec: chat_prompt_ids(tokenizer, rec),
                                          decode=decode, scorer=self.own_rewards or rewards, reward_budget=budget)
        self.decode = decode
        self.records = Path(cfg.logging.eval_records) if cfg.logging.eval_records else None

    def run(self, step: int) -> dict[str, float]:
        """Evaluate the servers' current weights; metrics as the module docstring says."""
        t0 = time.perf_counter()
        n = len(self.prompts) if self.cfg.eval.max_prompts is None else min(len(self.prompts), self.cfg.eval.max_prompts)
        rows = (self.prompts[i] for i in range(n))
        groups = self.manager.generate_step(rows, n).groups
        groups.sort(key=lambda g: g[0].group_id)
        metrics = eval_metrics(groups)
        metrics["time/eval"] = time.perf_counter() - t0
        if self.records is not None:
            self.records.parent.mkdir(parents=True, exist_ok=True)
            with self.records.open("a") as f:
                for g in groups:
                    for s in g:
                        f.write(json.dumps({
                            "step": step, "prompt_index": s.group_id - groups[0][0].group_id, "index": s.index,
                            "data_source": s.prompt.get("data_source"), "answer": s.prompt.get("answer"),
                            "prompt_ids": s.prompt_ids, "response_ids": s.response_ids,
                            "response": self.decode(s.response_ids), "reward": s.reward}, default=str) + "\n")
        return metrics

    def close(self) -> None:
        self.manager.close()
        if self.own_rewards is not None:
            self.own_rewards.close()
