"""Run configuration: the schema. One dataclass per section, one docstring per field (megatron style).

    cfg = load_config("examples/tiny_moe_larger_digit.yaml", ["parallel.tensor=2", "train.steps=3"])
    print(cfg.describe_loss())   # the effective loss settings, printed by the trainer at start

A YAML file holds any subset of the sections below; `--set a.b=c` overrides one field, the value
parsed as YAML (`3`, `1e-6`, `true`, `[http://h:1, http://h:2]`, `null`). Everything is validated
before the run starts: an unknown key, a wrong type or an out-of-range value raises ConfigError that
names the field and the bad value. `gspo-megatron config` prints every field with its docstring.

The sections ARE the settings of the components that use them, not copies: `parallel` is the
actor's ParallelLayout, `compute` its ComputeSettings, `loss` its LossSettings, `train` its
OptimizerSettings and MicroBatchSettings (plus
the loop's own fields), `rollout` the rollout manager's ManagerConfig (plus prompts, reward and servers). Nothing
here imports torch (a config error costs a fraction of a second); parsing.py is the generic
YAML / override machinery.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Literal

from gspo_megatron.actor.settings import (ComputeSettings, MicroBatchSettings, OptimizerSettings,
                                          RoutingSettings)
from gspo_megatron.algorithms.advantage.table import AdvantageSettings
from gspo_megatron.algorithms.registry import LOSSES, LossSettings
from gspo_megatron.config.parsing import CHECK, CHOICES_LABEL, CHOOSE, SETTINGS_OF, TABLE, describe
from gspo_megatron.parallel.layout import ParallelLayout
from gspo_megatron.sync.transports import TRANSPORTS
from gspo_tables import Table, row_settings
from rollout.servers.health import ServerHealthSettings
from rollout.generation.manager_config import ManagerConfig


def _families() -> Table:
    from model_specs.families import FAMILIES  # the feature modules load when described only
    return FAMILIES


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
class ModelConfig:
    hf_path: str = dataclasses.field(default="", metadata={TABLE: _families, CHOICES_LABEL: "Families"})
    """Hugging Face model directory (config.json, safetensors, tokenizer): the initial policy, the
    tokenizer, and what the SGLang servers load first. Its config.json's model_type names its
    family, a row of FAMILIES (model_specs/families/: the features each is built from)."""
    megatron_checkpoint: str | None = None
    """Optional megatron dist_checkpointing directory (tools/convert_hf_to_megatron.py) to load the
    initial weights from instead of hf_path's safetensors. A resume from checkpoint.dir wins."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype of the trainer (float32 on CPU: exact log-prob parity with SGLang)."""


@dataclasses.dataclass
class LossConfig(LossSettings, AdvantageSettings):
    name: str = dataclasses.field(default="gspo", metadata={TABLE: lambda: LOSSES, CHOOSE: lambda row: row.rl})
    """Policy loss, a row of LOSSES (gspo_megatron/algorithms/registry.py) or package.module:Name of a
    LossSpec of your own. "ce" (the warm start's cross-entropy) is not a policy loss."""

    def __post_init__(self) -> None:
        LossSettings.__post_init__(self)
        AdvantageSettings.__post_init__(self)
        LOSSES.row(self.name, "name", lambda row: row.rl)  # "ce" is the warm start's, not a policy loss

    @property
    def reference_reason(self) -> str:
        """The field that needs the reference policy ("loss.kl_coef=0.1"), or "" when none does."""
        if self.kl_coef > 0:
            return f"loss.kl_coef={self.kl_coef:g}"
        return f"loss.kl_in_reward_coef={self.kl_in_reward_coef:g}" if self.kl_in_reward else ""

    def describe(self) -> str:
        return f"{LossSettings.describe(self)} | {AdvantageSettings.describe(self)}"


@dataclasses.dataclass
class RolloutConfig(ManagerConfig, ServerHealthSettings):
    prompts: str | list[str] = ""
    """The prompt set: a jsonl file, a parquet file, a folder of parquet shards (train-*.parquet, as
    `datasets` writes them), a folder saved by datasets' save_to_disk, or a list of these (read in
    order). Local paths only: these machines have no dataset hub. Large sets are memory-mapped,
    never read whole (rollout/prompts/sets.py)."""
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
class TrainConfig(OptimizerSettings, MicroBatchSettings):
    steps: int = 100
    """RL steps (rollout batches) to run in total (a resumed run continues up to this)."""
    mini_batches: int = 4
    """Optimizer updates per rollout batch (the paper splits each batch into 4 mini-batches)."""
    old_log_probs: Literal["recompute", "engine"] = "recompute"
    """pi_old: recompute with a forward-only pass, or use SGLang's own log-probs (paper §5.4)."""
    seed: int = 1234
    """Seed of model init, prompt order and everything else random in the trainer."""
    warm_start_steps: int = 0
    """Supervised warm start: this many cross-entropy steps on the prompt file's answers before RL
    (0 = none). Teaches a tiny random model the answer format so the reward is not all zeros."""
    warm_start_lr: float = 1e-3
    """Learning rate of the warm start. It uses RL's optimizer, whose state is then cleared (RL
    starts with fresh Adam moments and its own learning-rate schedule)."""
    warm_start_batch_size: int = 32
    """Examples per warm-start step."""
    max_staleness: int = 0
    """Asynchronous RL: rollouts keep generating while the trainer trains (rollout/generation/async_rollouts.py).
    A sample whose oldest trained token came from weight version v trains at version V only if
    V - v <= max_staleness (else rollout.stale_policy). 0 = the synchronous loop (rollout, train,
    sync in turn). pi_old stays exact: each token's is the policy that generated it (the engine's
    log-prob of that version, or recomputed with that version's weights, kept on the host for
    max_staleness versions: docs/async.md)."""

    def __post_init__(self) -> None:
        OptimizerSettings.__post_init__(self)
        MicroBatchSettings.__post_init__(self)

    def decay_steps(self) -> int:
        """The learning rate decays over every optimizer step of the run unless lr_decay_steps says."""
        return self.lr_decay_steps or max(1, self.steps * self.mini_batches)


@dataclasses.dataclass
class SyncConfig:
    transport: str = dataclasses.field(default="disk", metadata={TABLE: lambda: TRANSPORTS})
    """How the weights reach the servers, a row of TRANSPORTS (gspo_megatron/sync/transports.py) or
    package.module:Name of a TransportRow of your own."""
    transport_args: dict[str, Any] = dataclasses.field(default_factory=dict, metadata={SETTINGS_OF: "transport"})
    """The transport's own settings, for a transport that declares some; {} for the shipped ones."""
    bucket_mb: int = 512
    """Size bound of one transfer bucket, and of one request (per sender)."""
    senders: Literal["owners", "rank0"] = "owners"
    """owners: every rank that holds full tensors after the TP gather sends its own, concurrently.
    rank0: the owners hand theirs to trainer rank 0, which sends them all (the same sync with one
    sender; for comparison)."""
    delta: bool | None = None
    """After a server's first full sync, send only the elements that changed, in the served dtype
    (each sender keeps its last sent values on the host: model bytes in that dtype / senders),
    applied and checksummed by the project's SGLang loader (docs/sync.md). null: wherever the
    transport can carry deltas (TRANSPORTS' `deltas`: tensor and distributed, not disk); true: the
    same, refused at start with a transport that cannot; false: whole tensors every sync."""
    dir: str | None = None
    """Folder of the disk transport's weight versions (and of any transport that keeps copies of the
    model: its row's folder_versions), on a file system every server can read (null: under
    checkpoint.dir, else the run folder). It holds two copies of the model at most; the start checks
    that they fit. A folder the run owns (locked, checked for room, emptied of stale versions), so it
    stays a field of the section, not a transport's own setting."""

    def __post_init__(self) -> None:
        self.transport_settings = row_settings(TRANSPORTS.row(self.transport, "transport"), self.transport_args,
                                               "transport_args")


@dataclasses.dataclass
class CheckpointConfig:
    dir: str | None = None
    """Checkpoint directory; null = no checkpoints. A run resumes from dir/latest if it exists."""
    interval: int = 10
    """Save every this many steps (and after the last step)."""
    keep: int = 2
    """Complete checkpoints kept (older ones deleted); 0 = keep all."""
    export_hf: str | None = None
    """Write the final policy in HF format here at the end of the run (null = no export). The
    folder is written beside its place and renamed into it: it may be new, empty or an earlier
    export (marked by gspo_export.json); anything else, and model.hf_path or a folder holding it,
    is refused at start."""
    save_on_signal: bool = True
    """On SIGTERM or SIGUSR1 (Slurm preemption, scancel, the time-limit signal of the launch
    scripts): abandon a rollout in progress, or finish the step in its train phase, save a
    checkpoint and exit with 128 + the signal number; a second signal exits at once (run/signals.py).
    false: the signal's default action (the process dies; the last checkpoint stays)."""
    verify_checksums: bool = True
    """Record a CRC32 of every checkpoint file at save and check it on resume (each rank checks a
    share of the files), naming a damaged file before anything starts. Costs one read of the
    checkpoint at save and at resume (benchmarks/checksum.py, 2.7 GB checkpoint of the 911 MB
    model: +0.6 s on a 3.3 s save, 0.5 s to verify from the page cache; the CRC runs at ~4.6 GB/s,
    a cold read is disk-bound); false for huge checkpoints on slow storage (sizes are still checked)."""


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


@dataclasses.dataclass
class DistillConfig:
    """On-policy distillation (docs/algorithm.md): a teacher served by SGLang scores the student's own
    samples token by token, and the student trains toward it through GSPO-token."""

    teacher: str | None = None
    """The teacher: a Hugging Face model directory with the student's tokenizer (null = off). Its
    servers never receive the student's weights."""
    teacher_server_urls: list[str] = dataclasses.field(default_factory=list)
    """SGLang servers already serving the teacher; empty = the run starts teacher_num_servers."""
    teacher_num_servers: int = 1
    """Local teacher servers to start when teacher_server_urls is empty."""
    teacher_server_extra_args: list[str] = dataclasses.field(default_factory=list)
    """More `sglang.launch_server` flags for local teacher servers."""
    coef: float = 1.0
    """Weight of the per-token term log pi_teacher(y_t) - log pi_old(y_t) in each token's advantage."""
    reward_coef: float = 1.0
    """Weight of the task reward's group advantage (GSPO Eq. 6); 0 = pure distillation."""
    max_in_flight: int = 64
    """Teacher requests (one prefill per sample) in flight at once."""


@dataclasses.dataclass
class LoggingConfig:
    tensorboard_dir: str | None = "runs/gspo"
    """TensorBoard event directory (null = off). `tensorboard --logdir` it."""
    metrics_jsonl: str | None = None
    """Also append each step's metrics as one JSON line here (null: tensorboard_dir/metrics.jsonl)."""
    progress: bool = True
    """Print a one-line progress display per step on rank 0."""
    eval_records: str | None = None
    """Append every eval response (step, prompt row, response ids and text, reward, data_source) as
    one JSON line here (null = off)."""
    rollout_records: str | None = None
    """Append every rollout sample of every step as one JSON line here (null = off): prompt and
    response ids, loss mask, log-probs, weight versions, rewards and, for episodes, each turn's
    server output and environment tokens, with the trained row as the actor received it."""


@dataclasses.dataclass
class RunConfig:
    plugins: list[str] = dataclasses.field(default_factory=list)
    """Modules of installed packages imported before anything else is read (on every rank and in every
    reward worker): each registers its rows in the tables (a loss, an estimator, a reward, a
    transport, a family, ...; docs/extending.md), which the other fields may then name. A row can
    also be named directly as package.module:Name where a name is expected."""
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    """The policy model."""
    parallel: ParallelLayout = dataclasses.field(default_factory=ParallelLayout)
    """Parallel layout of the trainer ranks (data parallel = the rest of the world size)."""
    compute: ComputeSettings = dataclasses.field(default_factory=ComputeSettings)
    """Layer implementation (TE or local), fused kernels and recomputation; null = what the
    machine supports."""
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    """Policy-gradient loss, its clip ranges, aggregation and the train/inference mismatch
    corrections; the advantage estimator and the reward and advantage shaping."""
    moe: RoutingSettings = dataclasses.field(default_factory=RoutingSettings)
    """MoE routing: replay of SGLang's experts (R3), routing drift and engine-vs-megatron metrics."""
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    """Prompts, sampling, reward and SGLang servers."""
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    """Steps, batches, optimizer."""
    sync: SyncConfig = dataclasses.field(default_factory=SyncConfig)
    """Weight sync into SGLang."""
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    """Evaluation on a held-out prompt set during training."""
    distill: DistillConfig = dataclasses.field(default_factory=DistillConfig)
    """On-policy distillation from a teacher model (off unless distill.teacher is set)."""
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    """Checkpoints and resume."""
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    """TensorBoard and progress output."""

    # --- derived -----------------------------------------------------------------------------
    def eval_reward_args(self) -> dict[str, Any]:
        """The eval reward's own settings as plain data (eval.reward_args; null: rollout's when the
        eval's reward is rollout's, else the reward's defaults)."""
        if self.eval.reward_args is not None:
            return dict(self.eval.reward_args)
        return dict(self.rollout.reward_args) if (self.eval.reward or self.rollout.reward) == self.rollout.reward else {}

    def describe_loss(self) -> str:
        return (f"{self.loss.describe()} | G={self.rollout.group_size} x "
                f"{self.rollout.prompts_per_step} prompts, {self.train.mini_batches} mini-batches/step, "
                f"old_log_probs={self.train.old_log_probs}, temperature={self.rollout.temperature:g}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


MOVED = {
    "loss.group_std": "loss.estimator_args: {group_std: ...} (a setting of the grpo estimator)",
    "loss.gamma": "loss.estimator_args: {gamma: ...} (a setting of the return estimators: reinforce, "
                  "reinforce_plus_plus)",
    "loss.token_sum_norm": "loss.aggregation_args: {token_sum_norm: ...} (a setting of the "
                           "seq-mean-token-sum-norm aggregation)",
    "rollout.code_sandbox": "rollout.reward_args: {...} (the code reward's own settings: time_limit_s, "
                            "memory_mb, isolation, scoring, ...)",
    "rollout.reward_service": "rollout.reward_args: {...} (a reward service's own settings: timeout_s, "
                              "retries, backoff_s, headers)",
}
"""Keys that moved into a row's own settings: refused in one line naming the new place (loading.py)."""


def describe_fields() -> str:
    """Every field: `section.name (type, default) docstring` — `gspo-megatron config`."""
    return describe(RunConfig)
