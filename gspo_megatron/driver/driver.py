"""The driver side of the RL loop (trainer rank 0): SGLang servers, prompts, rollouts, rewards,
group advantages.

    driver = Driver.start(cfg, log_dir, cache_dir)               # rank 0: starts or attaches servers
    batch, metrics = driver.rollout_batch(weight_version="3")    # rank 0: a TrainBatch
    held_out = on_driver(rank, lambda: driver.evaluate(step))    # parallel/rank_zero.py: every rank
                                                                 # gets rank 0's result

The rollout batch itself is not broadcast: each rank receives only its rows (actor/batching/transfer.py).

rollout/ knows nothing of megatron; this module turns its Samples into the actor's TrainBatch.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from gspo_megatron.actor.batching.batch import TrainBatch
from gspo_megatron.algorithms.advantage.shaping import RunningMoments
from gspo_megatron.config import RunConfig
from gspo_megatron.driver.environment import env_factory, reward_workers
from gspo_megatron.driver.records import RolloutRecords
from gspo_megatron.driver.rollout_metrics import alignment_metrics, rollout_metrics
from gspo_megatron.driver.samples_to_batch import policy_lag, samples_to_batch
from gspo_megatron.driver.servers import start_policy_servers, start_teachers, wants_engine_routing
from gspo_megatron.driver.staleness import take_fresh_groups
from gspo_megatron.driver.warm_start import warm_start_examples
from model_specs.hf.config import load_hf_config
from rollout.generation.async_rollouts import AsyncRollouts
from rollout.generation.multiturn.chat import ChatTemplate
from rollout.servers.errors import NoServerLeft
from rollout.prompts.dataset import KeptRows, PromptStream, chat_prompt_ids, load_prompts
from rollout.prompts.sets import PromptSet
from rollout.servers.health import GONE, LIVE, REJOINING, HealthMonitor
from rollout.generation.manager import RolloutInterrupted, RolloutManager
from rollout.servers.pool import TEACHER, ServerPool
from rollout.rewards import RewardWorkerPool
from rollout.servers.launch import ServerGroup
from rollout.generation.teacher import TeacherScorer

if TYPE_CHECKING:
    from gspo_megatron.driver.evaluation import Evaluator


class Driver:
    """Rank 0's half of the loop. Owns the servers it started (stop() ends them)."""

    def __init__(self, cfg: RunConfig, servers: ServerGroup, records: PromptSet,
                 teachers: ServerGroup | None = None, cache_dir: Path | None = None):
        from transformers import AutoTokenizer
        r = dataclasses.replace(cfg.rollout, return_routed_experts=wants_engine_routing(cfg))
        self.cfg, self.servers, self.cache_dir = cfg, servers, cache_dir
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.hf_path)
        self.prompts = records
        self.stream = PromptStream(self.prompts, seed=cfg.train.seed, shuffle=r.shuffle_prompts)
        layout = None
        if r.return_routed_experts:  # (layers, top-k) of the engine's routing, from the model's config
            hf = load_hf_config(cfg.model.hf_path)
            layout = (int(hf["num_hidden_layers"]), int(hf["num_experts_per_tok"]))
        self.pool = ServerPool(servers.server_urls, servers.router_url, timeout_s=r.request_timeout_s,
                               routed_experts_layout=layout, log=_say)
        if cfg.lora.enabled:  # every generation runs with the run's adapter (sync/adapter_sync.py)
            from gspo_megatron.lora.serving import ADAPTER_NAME
            self.pool.use_adapter(ADAPTER_NAME)

        def decode(ids: list[int]) -> str:
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            if not isinstance(text, str):  # one sequence of ids decodes to one string
                raise TypeError(f"the tokenizer decoded one sequence to {type(text).__name__}")
            return text
        self.env_factory = env_factory(r) if r.environment else None
        self.teachers, self.teacher = teachers, None
        if teachers is not None:  # on-policy distillation: another pool, outside the weight sync
            self.teacher = TeacherScorer(ServerPool(teachers.server_urls, timeout_s=r.request_timeout_s,
                                                    log=_say, role=TEACHER),
                                         max_in_flight=cfg.distill.max_in_flight, timeout_s=r.request_timeout_s)
        self.rewards: RewardWorkerPool | None = None
        self.chat: ChatTemplate | None = None  # multi-turn: the tokenizer's chat template
        if self.env_factory is not None:  # multi-turn: the environment gives the rewards
            self.chat = ChatTemplate(self.tokenizer)
            self.manager = RolloutManager(self.pool, r, decode=decode, env_factory=self.env_factory,
                                          chat=self.chat, max_turns=r.max_turns, teacher=self.teacher)
        else:
            self.rewards = reward_workers(cfg)  # starts its workers now, while the run sets up
            print(f"[gspo] reward: {r.reward} in {r.reward_workers} worker processes, at most "
                  f"{r.reward_timeout_s:g} s a call", flush=True)
            self.manager = RolloutManager(
                self.pool, r,  # the rollout config section is the manager's config (and more)
                encode_prompt=lambda rec: chat_prompt_ids(self.tokenizer, rec), decode=decode,
                scorer=self.rewards, teacher=self.teacher)
        self.records = RolloutRecords(cfg.logging.rollout_records, advantages_on_last_stage=cfg.loss.kl_in_reward) \
            if cfg.logging.rollout_records else None
        self.producer: AsyncRollouts | None = None  # train.max_staleness > 0: start_async()
        self._async_state: dict[str, Any] | None = None  # a resume's queue, until start_async()
        self.evaluator: Evaluator | None = None  # eval: made at its first use
        # loss.reward_norm_* = running: the run's reward statistics (checkpointed with the buffer)
        self.reward_moments = RunningMoments() if "running" in (cfg.loss.reward_norm_mean,
                                                                 cfg.loss.reward_norm_std) else None
        # last, once nothing can fail: probes each server, restarts those this run launched
        self.health = HealthMonitor(self.pool, r, launched=servers.launched(), log=_say).start()
        self.teacher_health = None if teachers is None or self.teacher is None else \
            HealthMonitor(self.teacher.pool, r, launched=teachers.launched(), log=_say).start()

    @classmethod
    def start(cls, cfg: RunConfig, log_dir: str | None = None, cache_dir: Path | None = None,
              prompt_rows: KeptRows | None = None) -> "Driver":
        """Attach to rollout.server_urls, or launch rollout.num_servers local servers (servers.py).
        log_dir: the servers' logs; cache_dir: where parquet prompt sets are memory-mapped from
        (rollout/prompts/sets.py); prompt_rows: the rows of the prompt set to use (rollout.max_prompt_tokens;
        None: all)."""
        r = cfg.rollout
        # A bad prompt set fails before any server starts; parquet is memory-mapped from a cache
        # in the run's folder, made here once.
        records = load_prompts(r.prompts, r.prompt_key, r.answer_key, cache_dir=cache_dir,
                               prompt_format=r.prompt_format)
        if prompt_rows is not None:
            records = records.with_kept(prompt_rows)
        servers = start_policy_servers(cfg, log_dir)
        teachers = None
        try:
            teachers = start_teachers(cfg, log_dir)
            return cls(cfg, servers, records, teachers, cache_dir)
        except BaseException:
            servers.stop()
            if teachers is not None:
                teachers.stop()
            raise

    def rollout_batch(self, weight_version: str, step: int, should_stop: Callable[[], bool] | None = None,
                      oldest_version: int | None = None) -> tuple[TrainBatch, dict[str, float]] | None:
        """One rollout batch for the policy of `weight_version`: (TrainBatch, rollout metrics);
        None when `should_stop` interrupted it (nothing of the step is lost: the same prompts
        come again). Synchronous: generated now, with that policy. Asynchronous (a producer): the
        next groups the rollout thread finished, those whose oldest trained token is older than
        `oldest_version` generated again or dropped (rollout.stale_policy)."""
        r = self.cfg.rollout
        if self.producer is not None:
            got = take_fresh_groups(self.producer, r.prompts_per_step, int(weight_version),
                                    oldest_version, r.stale_policy, should_stop)
            if got is None:
                return None
            groups, manager_metrics = got
        else:
            before = self.state() if should_stop is not None else None
            try:
                result = self.manager.generate_step(self.stream, r.prompts_per_step,
                                                    current_weight_version=weight_version,
                                                    should_stop=should_stop)
            except RolloutInterrupted:
                if before is None:  # only a step that can be stopped is interrupted
                    raise
                self.load_state(before["stream"], before["manager"])
                return None
            except NoServerLeft:  # the step's prompts come again once a server is back
                if before is not None:
                    self.load_state(before["stream"], before["manager"])
                raise
            groups, manager_metrics = result.groups, result.metrics
        per_token = r.environment is not None and r.turn_credit == "return_to_go"
        shaping: dict[str, float] = {}
        batch = samples_to_batch(groups, r.group_size, turn_discount=r.turn_discount if per_token else None,
                                 advantage=self.cfg.loss, running=self.reward_moments, metrics=shaping)
        metrics = rollout_metrics(groups, manager_metrics)
        aligned, problem = alignment_metrics([s for g in groups for s in g])
        metrics.update(aligned)
        if problem is not None:
            _say(f"step {step}: a rollout sample's records are not paired: {problem}")
        metrics.update({f"rollout/{k}": v for k, v in shaping.items()})
        metrics["rollout/policy_lag_max"] = policy_lag(batch, int(weight_version))
        for pool in self.pools():  # servers live, failures, restarts, resubmitted (and the teacher's)
            metrics.update(pool.pop_health_metrics())
        if self.records is not None:
            self.records.write(step, [s for g in groups for s in g], batch)
        for g in groups:  # the routes live on in the batch only, compact: held once
            for s in g:
                s.routed_experts = None
        return batch, metrics

    # --- asynchronous rollouts (train.max_staleness > 0) -------------------------------------
    def start_async(self, version: Callable[[], str]) -> None:
        """Start the rollout thread (after a resume's load_state): it generates with the
        servers' current weights, labelled by `version()`, until stop()."""
        r, t = self.cfg.rollout, self.cfg.train
        if self.producer is None:
            self.producer = AsyncRollouts(
                self.manager, self.stream, batch_groups=r.prompts_per_step,
                max_groups=r.max_buffered_groups or r.prompts_per_step * (t.max_staleness + 1),
                max_tokens=r.max_buffered_tokens, version=version)
            if self._async_state:
                self.producer.load_state(self._async_state)
            self.producer.start()

    def pools(self) -> list[ServerPool]:
        """The policy's servers, and the teacher's (on-policy distillation)."""
        return [self.pool] + ([self.teacher.pool] if self.teacher is not None else [])

    def pools_without_server(self) -> list[ServerPool]:
        """The pools with no server in service (live, or rejoining at the next weight sync)."""
        return [p for p in self.pools() if not any(p.status(u) in (LIVE, REJOINING) for u in p.server_urls)]

    def lost_servers(self) -> tuple[str, str]:
        """(what is missing, e.g. "SGLang server" or "teacher server", each of its servers and
        what happened to it), for the line that ends a run without servers."""
        lacking = self.pools_without_server() or [self.pool]
        return (" and ".join(p.role.name for p in lacking),
                "; ".join(p.summary() for p in lacking))

    def wait_for_server(self, should_stop: Callable[[], bool]) -> tuple[bool, float]:
        """No server left in service, the policy's or the teacher's: wait, rollout.server_wait_s
        at most, for each pool to have one again (restarted by its health monitor, or an attached
        one answering again). (True, seconds waited) when they do (a policy server rejoining: the
        caller syncs the weights into it); False when the wait ran out, a pool's servers are all
        past their restart bound (at once), or `should_stop` (a signal) says so."""
        t0 = time.monotonic()
        deadline = t0 + self.cfg.rollout.server_wait_s
        what, summary = self.lost_servers()
        _say(f"no {what} in service: waiting up to {self.cfg.rollout.server_wait_s:g} s "
             f"(rollout.server_wait_s) for one to come back ({summary})")
        while time.monotonic() < deadline and not should_stop():
            lacking = self.pools_without_server()
            if not lacking:
                return True, time.monotonic() - t0
            if any(all(p.status(u) == GONE for u in p.server_urls) for p in lacking):
                break
            time.sleep(0.5)
        return False, time.monotonic() - t0

    def policy_needs_sync(self) -> bool:
        """A policy server came back and waits for the current weights (only a teacher server
        was missing: nothing to sync)."""
        return any(self.pool.status(u) == REJOINING for u in self.pool.server_urls)

    def restart_rollouts(self) -> None:
        """Asynchronous: after the servers came back, a new rollout thread in place of the one that
        stopped for want of a server, with its queue (nothing it finished is lost)."""
        old = self.producer
        if old is None or old.error is None:
            return
        old.close()
        self._async_state, self.producer = old.to_state(), None
        self.start_async(old.version)

    def evaluate(self, step: int) -> dict[str, float]:
        """The held-out evaluation of the servers' current weights (evaluation.py)."""
        if self.evaluator is None:
            from gspo_megatron.driver.evaluation import Evaluator
            self.evaluator = Evaluator(self.cfg, self.pool, self.tokenizer, self.manager.decode, rewards=self.rewards,
                                       env_factory=self.env_factory, chat=self.chat, cache_dir=self.cache_dir)
        return self.evaluator.run(step)

    def paused(self):
        """Nothing generates inside (a weight sync, a checkpoint); a no-op when synchronous."""
        return self.producer.paused() if self.producer is not None else contextlib.nullcontext()

    def warm_start_examples(self, n: int, offset: int) -> list[tuple[list[int], list[int], list[int]]]:
        """n (prompt ids, response ids, response loss mask) for the supervised warm start, cycling
        through the prompt set from `offset` (warm_start.py)."""
        return warm_start_examples(self.prompts, n, offset, self.tokenizer, self.env_factory, self.chat)

    # --- state -------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """The prompt cursor and the rollout state (asynchronous: taken with the rollout thread
        paused, its finished groups and in-flight ones, cut short, with their versions)."""
        with self.paused():
            manager = self.manager.to_state()
            if self.producer is not None:
                manager["async"] = self.producer.to_state()
            if self.reward_moments is not None:
                manager["reward_moments"] = self.reward_moments.to_state()
            return {"stream": self.stream.to_state(), "manager": manager}

    def load_state(self, cursor: dict[str, Any], buffer: dict[str, Any]) -> None:
        if cursor:
            self.stream.load_state(cursor)
        if buffer:
            buffer = dict(buffer)
            moments = buffer.pop("reward_moments", None)
            if self.reward_moments is not None:
                self.reward_moments = RunningMoments.from_state(moments)
            self._async_state = buffer.pop("async", None)
            if self._async_state and self.producer is not None:
                self.producer.load_state(self._async_state)
            self.manager.load_state(buffer)

    def stop(self) -> None:
        self.health.close()  # first: no restart may race the servers' stop below
        if self.teacher_health is not None:
            self.teacher_health.close()
        if self.producer is not None:
            self.producer.close()
        if self.evaluator is not None:
            self.evaluator.close()
        try:
            self.manager.close()
            if self.rewards is not None:
                self.rewards.close()
            if self.teacher is not None:
                self.teacher.close()
                self.teacher.pool.close()
            self.pool.close()
        finally:
            self.servers.stop()
            if self.teachers is not None:
                self.teachers.stop()


def _say(line: str) -> None:
    print(f"[gspo] {line}", flush=True)
