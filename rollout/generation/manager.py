"""Rollout manager: G samples per prompt from SGLang, dynamic sampling, partial rollouts.

    manager = RolloutManager(pool, ManagerConfig(group_size=8, max_new_tokens=512),
                             encode_prompt=lambda rec: chat_prompt_ids(tok, rec),
                             decode=tok.decode, scorer=RewardWorkerPool("math", workers=8, timeout_s=60))
    result = manager.generate_step(prompt_iter, num_groups=32)   # -> result.groups, result.metrics
    state = manager.to_state()      # the buffer of unfinished groups, for the trainer's checkpoint

One HTTP request per sample (segment), up to `max_in_flight_requests` at once; SGLang batches them.
The manager holds what lasts between steps (the group buffer, groups.py: unfinished and ready
groups and the group ids; the reward error budget) and the request threads (requests.py: one
request or episode per sample); one step's own state is a StepGeneration (step.py), which is
handed these parts (StepParts), not the manager.
Partial rollouts (paper-independent, as in slime/Kimi): once `num_groups` groups are complete the
rest are aborted, and their partial responses wait in the buffer; next step they resume from
prompt + partial response asking only for the REMAINING budget. Every token keeps the weight version
that produced it; `mask_stale_tokens` zeroes the loss mask of tokens from older weights.
Multi-turn episodes (an `env_factory`) run to completion and are never buffered: an episode cut
by the end-of-step abort is discarded (counted in metrics).

Rewards: a group whose responses are all done goes to the scorer (rollout/rewards: worker processes
with a hard time bound per call) and is closed when its scores come back; this thread only hands
groups over and waits on generation and scoring together, so scoring overlaps generation. A group
still being scored when the step stops, or is full, waits in the buffer and is scored again.
Multi-turn environments give their rewards during the episode (their own path).
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

from rollout.generation.multiturn.chat import ChatTemplate
from rollout.generation.groups import GroupBuffer
from rollout.generation.manager_config import ManagerConfig
from rollout.generation.multiturn import Environment
from rollout.generation.requests import SampleRequests
from rollout.generation.sample import Sample
from rollout.generation.step import RolloutInterrupted, StepGeneration, StepParts, StepResult  # noqa: F401 (re-exported)
from rollout.generation.teacher import TeacherScorer
from rollout.rewards.answers import RewardFn
from rollout.rewards.scoring import RewardErrorBudget, Scorer, ThreadScorer
from rollout.servers.pool import ServerPool


class RolloutManager:
    def __init__(self, pool: ServerPool, config: ManagerConfig, *,
                 encode_prompt: Callable[[dict], list[int]] | None = None, decode: Callable[[list[int]], str],
                 reward_fn: RewardFn | None = None, scorer: Scorer | None = None,
                 env_factory: Callable[[dict], Environment] | None = None,
                 encode_text: Callable[[str], list[int]] | None = None, chat: ChatTemplate | None = None,
                 max_turns: int | None = None, reward_budget: RewardErrorBudget | None = None,
                 teacher: TeacherScorer | None = None):
        """encode_prompt: prompt record -> prompt token ids (e.g. dataset.chat_prompt_ids).
        decode: token ids -> text, for reward functions and environments (never re-encoded).
        scorer: scores single-turn groups (rollout.rewards.RewardWorkerPool: processes, a hard
        time bound per call; not closed by this manager); or reward_fn: (record, response_text) ->
        float, an in-process callable scored on a thread of its own (ThreadScorer: no time bound).
        reward_budget: the run's reward error accounting, when shared (eval and training).
        teacher: on-policy distillation (rollout.generation.teacher.TeacherScorer): a group also waits for its
        teacher log-probs, requested beside its rewards.
        env_factory: record -> Environment, for multi-turn episodes (rollout.generation.multiturn), whose turns
        go through `chat` (rollout.generation.multiturn.chat.ChatTemplate: the tokenizer's template) or, without it,
        fixed ChatML markers tokenised with `encode_text` (its reset() message is the prompt, so
        encode_prompt is then unused). max_turns: bound on an episode's model turns (None: the
        environment's own)."""
        if env_factory is None and reward_fn is None and scorer is None:
            raise ValueError("RolloutManager needs a scorer or reward_fn (single-turn) or an env_factory")
        if env_factory is None and encode_prompt is None:
            raise ValueError("single-turn rollouts need encode_prompt")
        if env_factory is not None and encode_text is None and chat is None:
            raise ValueError("multi-turn (env_factory) needs a chat template (or encode_text)")
        self.pool, self.config = pool, config
        self.encode_prompt, self.decode, self.env_factory = encode_prompt, decode, env_factory
        self.requests = SampleRequests(pool, config, decode, env_factory=env_factory,
                                       encode_text=encode_text, chat=chat, max_turns=max_turns)
        self._own_scorer = ThreadScorer(reward_fn) if scorer is None and reward_fn is not None else None
        self.scorer = scorer or self._own_scorer
        self.teacher = teacher
        self.groups = GroupBuffer()
        """Unfinished groups a step left and complete ones a stopped step kept: the next step
        takes them first."""
        self.reward_budget = reward_budget or RewardErrorBudget(config.max_reward_error_fraction)

    @property
    def episodes(self) -> bool:
        """Multi-turn episodes (an env_factory): their rewards come from the environment."""
        return self.env_factory is not None

    def new_group(self, record: dict) -> list[Sample]:
        """A group of group_size fresh samples of one prompt record, with the next group id."""
        if self.episodes:  # the environment's reset() message is the prompt
            prompt_ids: list[int] = []
        elif self.encode_prompt is not None:
            prompt_ids = list(self.encode_prompt(record))
        else:
            raise ValueError("single-turn rollouts need encode_prompt")
        gid = self.groups.next_id()
        budget = int(record.get("max_new_tokens", self.config.max_new_tokens))
        return [Sample(gid, i, record, list(prompt_ids), budget)
                for i in range(self.config.group_size)]

    def generate_step(self, prompts: Iterator[dict], num_groups: int,
                      current_weight_version: str | None = None,
                      should_stop: Callable[[], bool] | None = None,
                      keep_on_stop: bool = False) -> StepResult:
        """Return `num_groups` complete groups: ready and buffered groups first, then new prompts
        from `prompts` (consumed lazily; over-sampling draws more). current_weight_version: the
        policy's version for mask_stale_tokens (default: the newest version seen in each sample).
        should_stop: polled every 0.2 s; when it says True the in-flight requests are aborted and
        RolloutInterrupted is raised. No server left in service (rollout/servers/health.py): the same stop,
        then NoServerLeft. keep_on_stop: nothing of the step is lost then: its complete
        groups go to `ready`, its unfinished ones (partial responses, their tokens' versions kept)
        to the front of the buffer, in group order; without it the caller restores a saved state."""
        return StepGeneration(self.parts(), prompts, num_groups, current_weight_version, should_stop,
                              keep_on_stop).run()

    def parts(self) -> StepParts:
        """What a step works with (step.py): this manager's collaborators, not the manager."""
        return StepParts(config=self.config, groups=self.groups, requests=self.requests, pool=self.pool,
                         new_group=self.new_group, episodes=self.episodes, scorer=self.scorer,
                         decode=self.decode, teacher=self.teacher, reward_budget=self.reward_budget)

    # --- checkpointing -----------------------------------------------------------------------
    def to_state(self) -> dict[str, Any]:
        """The group buffer and the counters as plain data (JSON-serialisable when prompt records are)."""
        return {**self.groups.to_state(), "reward_budget": self.reward_budget.to_state()}

    def load_state(self, state: dict[str, Any]) -> None:
        self.groups.load_state(state)
        self.reward_budget.load_state(state["reward_budget"])

    def close(self) -> None:
        self.requests.close()
        if self._own_scorer is not None:
            self._own_scorer.close()
