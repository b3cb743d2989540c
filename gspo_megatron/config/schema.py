"""Run configuration: the schema. One dataclass per section, one docstring per field (megatron style).

    cfg = load_config("examples/tiny_moe_larger_digit.yaml", ["parallel.tensor=2", "train.steps=3"])
    print(cfg.describe_loss())   # the effective loss settings, printed by the trainer at start

A YAML file holds any subset of the sections below; `--set a.b=c` overrides one field, the value
parsed as YAML (`3`, `1e-6`, `true`, `[http://h:1, http://h:2]`, `null`). Everything is validated
before the run starts: an unknown key, a wrong type or an out-of-range value raises ConfigError that
names the field and the bad value. `gspo-megatron config` prints every field with its docstring.

The sections ARE the settings of the components that use them, not copies: `parallel` is the
actor's ParallelLayout, `compute` its ComputeSettings, `loss` its LossSettings, `train` its
OptimizerSettings and MicroBatchSettings (plus the loop's own fields), `rollout` the rollout
manager's ManagerConfig (plus prompts, reward and servers: rollout_sections.py, with `eval`). Nothing
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
from gspo_megatron.config.parsing import CHOICES_LABEL, CHOOSE, SETTINGS_OF, TABLE, describe
from gspo_megatron.config.rollout_sections import EvalConfig, RolloutConfig
from gspo_megatron.lora.lora_settings import LoraSettings
from gspo_megatron.parallel.layout import ParallelLayout
from gspo_megatron.sync.transports import TRANSPORTS
from gspo_tables import Table, row_settings

__all__ = ["CheckpointConfig", "DistillConfig", "EvalConfig", "LoggingConfig", "LoraConfig", "LossConfig", "MOVED", "ModelConfig",
           "RolloutConfig", "RunConfig", "SyncConfig", "TrainConfig", "describe_fields"]


def _families() -> Table:
    from model_specs.families import FAMILIES  # the feature modules load when described only
    return FAMILIES


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
class LoraConfig(LoraSettings):
    init_peft: str | None = None
    """A PEFT adapter folder (adapter_config.json and adapter_model.safetensors with SGLang's names,
    as lora.export_peft writes it) the adapters start from, trained on model.hf_path with this
    rank, alpha, targets and experts layout; null: A drawn from train.seed, B zero. A resume
    from checkpoint.dir wins."""
    export_peft: str | None = None
    """Write the final adapters here as a PEFT folder at the end of the run (null = no export):
    SGLang's /load_lora_adapter and a later run's lora.init_peft read it. Written beside its place
    and renamed into it, as checkpoint.export_hf (which, with LoRA, holds the merged policy)."""


@dataclasses.dataclass
class SyncConfig:
    transport: str = dataclasses.field(default="disk", metadata={TABLE: lambda: TRANSPORTS})
    """How the weights reach the servers, a row of TRANSPORTS (gspo_megatron/sync/transports.py) or
    package.module:Name of a TransportRow of your own."""
    transport_args: dict[str, Any] = dataclasses.field(default_factory=dict, metadata={SETTINGS_OF: "transport"})
    """The transport's own settings, for a transport that declares some (tensor: cuda_ipc, CUDA IPC
    handles for servers on the trainers' GPUs); {}: its defaults."""
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
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    """LoRA: adapters on a frozen base (rank > 0). Only they train, are checkpointed and reach the
    servers (in place, a weight version per step); the KL reference is the base."""
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
