"""Run configuration: the sections of the rollouts, the reward and the evaluation (schema.py holds
the others and the whole RunConfig). Torch-free, as every section."""
from __future__ import annotations

import dataclasses
from typing import Any, Literal

from gspo_megatron.config.parsing import CHECK, SETTINGS_OF, TABLE
from gspo_tables import Table
from rollout.generation.manager_config import ManagerConfig
from rollout.servers.health import ServerHealthSettings


def _rewards() -> Table:
    from rollout.rewards.registry import REWARDS  # the reward functions load when described only
    return REWARDS


def _check_reward(name: str, field: str) -> None:
    from rollout.rewards.registry import reward_spec
    reward_spec(name, field)


def _environments() -> Table:
    from rollout.envs import ENVIRONMENTS
    return ENVIRONMENTS


def _prompt_formats() -> Table:
    from rollout.prompts.formats import PROMPT_FORMATS
    return PROMPT_FORMATS


@dataclasses.dataclass
class RolloutConfig(ManagerConfig, ServerHealthSettings):
    prompts: str | list[str] = ""
    """The prompt set: a path, or a list of paths read in order, each read as a row of PROMPT_FORMATS
    (rollout.prompt_format lists them). Local paths only: these machines have no dataset hub. Large
    sets are memory-mapped, never read whole (rollout/prompts/sets.py)."""
    prompt_format: str | None = dataclasses.field(default=None, metadata={TABLE: _prompt_formats})
    """How rollout.prompts (and eval.prompts) are read, a row of PROMPT_FORMATS
    (rollout/prompts/formats.py) or package.module:Name of a PromptFormat of your own; null = by each
    path's shape (the first format that claims it, a plug-in's included)."""
    prompt_key: str = "prompt"
    """Where a row keeps its prompt, a dotted path into nested fields; the prompt is a string or a
    list of {role, content} messages (both through the tokenizer's chat template)."""
    answer_key: str = "answer"
    """Where a row keeps the answer the reward checks, a dotted path (verl: reward_model.ground_truth).
    The row's other fields (data_source, extra_info, ...) reach the reward function and the
    environment as they are."""
    max_prompt_tokens: int | None = None
    """Drop prompts longer than this many tokens (through the chat template) when the set is
    loaded, and say how many (verl's filter_overlong_prompts); null = keep all."""
    reward: str = dataclasses.field(default="math", metadata={TABLE: _rewards, CHECK: _check_reward})
    """The reward: a row of REWARDS (rollout/rewards/registry.py) by name, an http(s):// reward
    service, or your own as package.module:function (fn(record, response_text) -> float) or
    package.module:Name of a RewardSpec with settings of its own (docs/rewards.md)."""
    reward_args: dict[str, Any] = dataclasses.field(default_factory=dict, metadata={SETTINGS_OF: "reward"})
    """The reward's own settings: code's sandbox (time_limit_s, memory_mb, isolation, scoring, ...:
    rollout/rewards/settings.py CodeSandboxSettings), a reward service's request settings (timeout_s,
    retries, backoff_s, headers: RewardServiceSettings), yours; {} for a reward without."""
    reward_workers: int = 4
    """Processes that score responses while generation goes on (rollout/rewards/workers.py); the
    thread that feeds the servers never scores. Also the number of requests in flight to an HTTP
    reward service. Multi-turn environments give their rewards in the episode instead."""
    reward_timeout_s: float = 60.0
    """Hard bound on one reward call (and on a prompt's preparation: parsing its gold or its tests):
    past it the worker is killed and replaced, and the response scores 0 with a reward error."""
    prompts_per_step: int = 8
    """Prompts (groups) per rollout batch; the batch has prompts_per_step x group_size responses."""
    shuffle_prompts: bool = True
    """Shuffle the prompt file each epoch (with train.seed)."""
    prompts_changed: Literal["refuse", "restart_epoch"] = "refuse"
    """A resume finds rollout.prompts changed since the checkpoint (its fingerprint: paths, bytes,
    records, SHA-256): refuse (one line, nothing started), or restart_epoch (a new epoch over the
    new set, from its start; the step count goes on)."""
    server_urls: list[str] = dataclasses.field(default_factory=list)
    """SGLang servers to use (cluster mode). Empty = the run starts num_servers local servers."""
    router_url: str | None = None
    """An sglang-router in front of server_urls (optional)."""
    num_servers: int = 1
    """Local servers to start when server_urls is empty."""
    server_max_total_tokens: int = 16384
    """KV-cache tokens of each local server (policy and teacher); on CPU, with the model's size and
    the free memory, what SGLang's --mem-fraction-static is derived from (rollout/servers/memory.py)."""
    server_extra_args: list[str] = dataclasses.field(default_factory=list)
    """More `sglang.launch_server` flags for local servers."""
    server_startup_timeout_s: float = 300.0
    """How long to wait for a local server (or an attached one) to become healthy."""
    environment: str | None = dataclasses.field(default=None, metadata={TABLE: _environments})
    """Multi-turn episodes with this environment: a shipped one by name (ENVIRONMENTS,
    rollout/envs/__init__.py) or a class of your own, `package.module:ClassName`
    (rollout.generation.multiturn.Environment); null = single-turn responses scored by `reward`.
    The environment's rewards replace `reward`."""
    environment_args: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Keyword arguments of the environment class (one instance per episode)."""
    max_turns: int | None = None
    """Bound on an episode's model turns (null: the environment's own max_turns)."""
    turn_credit: Literal["episode", "return_to_go"] = "episode"
    """How a multi-turn episode's rewards become advantages: episode = the episode return, one
    advantage per sequence (GSPO); return_to_go = each turn gets the rewards from that turn on,
    against its group's baseline and scale (driver/turn_credit.py), one advantage per token:
    needs loss.name=gspo_token."""
    turn_discount: float = 1.0
    """Discount of later turns' rewards in return_to_go."""
    stale_policy: Literal["regenerate", "drop"] = "regenerate"
    """With train.max_staleness > 0: a group too stale to train is generated again from its prompt
    (regenerate: no prompt is lost) or dropped (drop: counted in async/dropped_stale)."""
    max_buffered_groups: int | None = None
    """With train.max_staleness > 0: finished groups waiting for the trainer, at most (the rollout
    thread waits instead of generating more); null = prompts_per_step x (max_staleness + 1)."""
    max_buffered_tokens: int | None = None
    """With train.max_staleness > 0: tokens of the finished groups waiting, at most; null = no bound
    beyond max_buffered_groups."""

    def __post_init__(self) -> None:
        from rollout.rewards.registry import reward_settings
        self.reward_settings = reward_settings(self.reward, self.reward_args, "reward_args")


@dataclasses.dataclass
class EvalConfig:
    prompts: str | list[str] = ""
    """A held-out prompt set (the same inputs as rollout.prompts); empty = no evaluation."""
    prompt_key: str | None = None
    """As rollout.prompt_key (null: rollout's)."""
    answer_key: str | None = None
    """As rollout.answer_key (null: rollout's)."""
    interval: int = 0
    """Evaluate before step 0, before every interval-th step, and after the last step, with the
    weights of that moment on the live servers; 0 = never."""
    samples_per_prompt: int = 1
    """n: responses per eval prompt; eval/accuracy is mean@n, eval/pass@k the fraction of prompts
    with at least one correct response among the n."""
    temperature: float = 0.0
    """Eval sampling temperature (0: greedy)."""
    top_p: float = 1.0
    """Eval nucleus sampling threshold."""
    max_new_tokens: int | None = None
    """Eval response budget (null: rollout.max_new_tokens)."""
    max_prompts: int | None = None
    """Evaluate on the first this many prompts of the set (null: all)."""
    reward: str | None = dataclasses.field(default=None, metadata={TABLE: _rewards, CHECK: _check_reward})
    """Reward of the eval, any that rollout.reward takes (null: rollout.reward; an environment's
    rewards when rollout.environment is set)."""
    reward_args: dict[str, Any] | None = dataclasses.field(default=None, metadata={SETTINGS_OF: "reward"})
    """Its own settings, as rollout.reward_args (null: rollout.reward_args when the eval's reward is
    rollout.reward, else the reward's defaults)."""
