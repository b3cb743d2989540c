"""Run configuration: dataclasses with one docstring per field (megatron style), YAML + overrides.

    cfg = load_config("examples/tiny_moe_digits.yaml", ["parallel.tensor=2", "train.steps=3"])
    print(cfg.describe_loss())   # the effective loss settings, printed by the trainer at start

A YAML file holds any subset of the sections below; `--set a.b=c` overrides one field, the value
parsed as YAML (`3`, `1e-6`, `true`, `[http://h:1, http://h:2]`, `null`). Everything is validated
before the run starts: an unknown key, a wrong type or an out-of-range value raises ConfigError that
names the field and the bad value. `gspo-megatron config` prints every field with its docstring.
"""
from __future__ import annotations

import ast
import copy
import dataclasses
import difflib
import inspect
import types
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

import yaml

from gspo_megatron.parallel.layout import ParallelLayout

LOSS_NAMES = ("gspo", "gspo_token", "grpo")
# The paper's clip ranges (GSPO.md): GSPO 3e-4 / 4e-4, GRPO baseline 0.2 / 0.27.
DEFAULT_CLIP = {"gspo": (3e-4, 4e-4), "gspo_token": (3e-4, 4e-4), "grpo": (0.2, 0.27)}


class ConfigError(ValueError):
    """A bad run configuration: the message names the field and the offending value."""


@dataclasses.dataclass
class ModelConfig:
    hf_path: str = ""
    """Hugging Face model directory (config.json, safetensors, tokenizer): the initial policy, the
    tokenizer, and what the SGLang servers load first."""
    megatron_checkpoint: str | None = None
    """Optional megatron dist_checkpointing directory (tools/convert_hf_to_megatron.py) to load the
    initial weights from instead of hf_path's safetensors. A resume from checkpoint.dir wins."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype of the trainer (float32 on CPU: exact log-prob parity with SGLang)."""


@dataclasses.dataclass
class LossConfig:
    name: Literal["gspo", "gspo_token", "grpo"] = "gspo"
    """Policy loss: gspo (sequence ratio, Eq. 5), gspo_token (Eqs. 13-14) or grpo (token ratio)."""
    eps_low: float | None = None
    """Lower clip range; null = the paper's value for the loss (gspo 3e-4, grpo 0.2)."""
    eps_high: float | None = None
    """Upper clip range; null = the paper's value for the loss (gspo 4e-4, grpo 0.27)."""
    kl_coef: float = 0.0
    """Weight of a KL penalty against the policy RL starts from (after any warm start; saved in
    checkpoint.dir/reference); 0 = off (the GSPO paper omits it)."""
    kl_estimator: Literal["k1", "k3"] = "k3"
    """KL estimator when kl_coef > 0."""

    def clip_range(self) -> tuple[float, float]:
        lo, hi = DEFAULT_CLIP[self.name]
        return (lo if self.eps_low is None else self.eps_low,
                hi if self.eps_high is None else self.eps_high)


@dataclasses.dataclass
class RolloutConfig:
    prompts: str = ""
    """Prompt file: jsonl, one {"prompt": ..., "answer": ...} record per line."""
    reward: str = "math"
    """Reward function name (rollout.rewards.get_reward_fn): math, exact_match, ..."""
    group_size: int = 8
    """G: responses sampled per prompt (GSPO's group)."""
    prompts_per_step: int = 8
    """Prompts (groups) per rollout batch; the batch has prompts_per_step x group_size responses."""
    max_new_tokens: int = 64
    """Response budget per sample."""
    temperature: float = 1.0
    """Sampling temperature; the trainer computes log-probs at the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling threshold (1.0 = off)."""
    top_k: int = -1
    """Top-k sampling (-1 = off; 1 = greedy, with log-probs of the full temperature-1 softmax)."""
    seed: int | None = None
    """Base of a per-request SGLang `sampling_seed` derived from (seed, group id, sample index,
    segment): rollouts fixed by the seed and the weights. Needs SGLang's deterministic inference
    (--enable-deterministic-inference, added to servers the run starts), which SGLang supports on
    GPU attention backends only, not on CPU. null = unseeded sampling."""
    shuffle_prompts: bool = True
    """Shuffle the prompt file each epoch (with train.seed)."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal and over-sample prompts to refill the batch."""
    partial_rollouts: bool = False
    """Abort unfinished samples once the batch is full and resume them next step."""
    mask_stale_tokens: bool = False
    """With partial rollouts: loss-mask tokens produced by older weights."""
    server_urls: list[str] = dataclasses.field(default_factory=list)
    """SGLang servers to use (cluster mode). Empty = the run starts num_servers local servers."""
    router_url: str | None = None
    """An sglang-router in front of server_urls (optional)."""
    num_servers: int = 1
    """Local servers to start when server_urls is empty."""
    server_max_total_tokens: int = 16384
    """KV-cache tokens of each local server."""
    server_extra_args: list[str] = dataclasses.field(default_factory=list)
    """More `sglang.launch_server` flags for local servers."""
    server_startup_timeout_s: float = 300.0
    """How long to wait for a local server (or an attached one) to become healthy."""
    request_timeout_s: float = 600.0
    """Bound on any single wait for generation results."""
    max_reward_error_fraction: float = 0.0
    """The run fails once more than this fraction of reward calls raised."""


@dataclasses.dataclass
class TrainConfig:
    steps: int = 100
    """RL steps (rollout batches) to run in total (a resumed run continues up to this)."""
    mini_batches: int = 4
    """Optimizer updates per rollout batch (the paper splits each batch into 4 mini-batches)."""
    micro_batch_size: int = 8
    """Sequences per forward/backward micro-batch on one data-parallel rank."""
    old_log_probs: Literal["recompute", "engine"] = "recompute"
    """pi_old: recompute with a forward-only pass, or use SGLang's own log-probs (paper §5.4)."""
    seed: int = 1234
    """Seed of model init, prompt order and everything else random in the trainer."""
    optimizer: Literal["adam", "sgd"] = "adam"
    """Optimizer (adam = AdamW)."""
    lr: float = 1e-6
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay."""
    lr_warmup_steps: int = 0
    """Linear warm-up over this many optimizer steps."""
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate schedule after warm-up (decays over all optimizer steps of the run)."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this; 0 = off."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state over data-parallel ranks (ZeRO-1)."""
    warm_start_steps: int = 0
    """Supervised warm start: this many cross-entropy steps on the prompt file's answers before RL
    (0 = none). Teaches a tiny random model the answer format so the reward is not all zeros."""
    warm_start_lr: float = 1e-3
    """Learning rate of the warm start (a separate optimizer; RL's optimizer is untouched)."""
    warm_start_batch_size: int = 32
    """Examples per warm-start step."""


@dataclasses.dataclass
class SyncConfig:
    transport: Literal["disk", "tensor", "distributed"] = "disk"
    """How updated weights reach SGLang: disk (safetensors), tensor, or distributed (broadcast)."""
    bucket_mb: int = 512
    """Size bound of one transfer bucket."""
    dir: str | None = None
    """Scratch directory of the disk transport (null: under checkpoint.dir or a temp dir)."""


@dataclasses.dataclass
class CheckpointConfig:
    dir: str | None = None
    """Checkpoint directory; null = no checkpoints. A run resumes from dir/latest if it exists."""
    interval: int = 10
    """Save every this many steps (and after the last step)."""
    keep: int = 2
    """Complete checkpoints kept (older ones deleted); 0 = keep all."""
    export_hf: str | None = None
    """Write the final policy in HF format here at the end of the run (null = no export)."""


@dataclasses.dataclass
class LoggingConfig:
    tensorboard_dir: str | None = "runs/gspo"
    """TensorBoard event directory (null = off). `tensorboard --logdir` it."""
    metrics_jsonl: str | None = None
    """Also append each step's metrics as one JSON line here (null: tensorboard_dir/metrics.jsonl)."""
    progress: bool = True
    """Print a one-line progress display per step on rank 0."""


@dataclasses.dataclass
class RunConfig:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    """The policy model."""
    parallel: ParallelLayout = dataclasses.field(default_factory=ParallelLayout)
    """Parallel layout of the trainer ranks (data parallel = the rest of the world size)."""
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    """Policy-gradient loss and its clip ranges."""
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    """Prompts, sampling, reward and SGLang servers."""
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    """Steps, batches, optimizer."""
    sync: SyncConfig = dataclasses.field(default_factory=SyncConfig)
    """Weight sync into SGLang."""
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    """Checkpoints and resume."""
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    """TensorBoard and progress output."""

    # --- derived -----------------------------------------------------------------------------
    def describe_loss(self) -> str:
        lo, hi = self.loss.clip_range()
        kl = (f"kl_coef={self.loss.kl_coef} ({self.loss.kl_estimator})" if self.loss.kl_coef
              else "KL off")
        return (f"loss={self.loss.name} eps_low={lo:g} eps_high={hi:g} {kl} | "
                f"G={self.rollout.group_size} x {self.rollout.prompts_per_step} prompts, "
                f"{self.train.mini_batches} mini-batches/step, old_log_probs="
                f"{self.train.old_log_probs}, temperature={self.rollout.temperature:g}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def validate(self) -> None:
        """Range and cross-field checks (types are checked while parsing)."""
        def need(cond: bool, field: str, value: Any, expected: str) -> None:
            if not cond:
                raise ConfigError(f"{field}={value!r}: expected {expected}")
        m, r, t, l, c = self.model, self.rollout, self.train, self.loss, self.checkpoint
        need(bool(m.hf_path), "model.hf_path", m.hf_path, "a Hugging Face model directory")
        need(bool(r.prompts), "rollout.prompts", r.prompts, "a jsonl prompt file")
        for name in ("tensor", "pipeline", "expert"):
            v = getattr(self.parallel, name)
            need(v >= 1, f"parallel.{name}", v, ">= 1")
        need(r.group_size >= 1, "rollout.group_size", r.group_size, ">= 1")
        need(r.prompts_per_step >= 1, "rollout.prompts_per_step", r.prompts_per_step, ">= 1")
        need(r.max_new_tokens >= 1, "rollout.max_new_tokens", r.max_new_tokens, ">= 1")
        need(r.temperature > 0, "rollout.temperature", r.temperature,
             "> 0 (log-probs are computed at this temperature; greedy has none)")
        need(0 < r.top_p <= 1, "rollout.top_p", r.top_p, "in (0, 1]")
        need(r.top_k == -1 or r.top_k >= 1, "rollout.top_k", r.top_k, "-1 (off) or >= 1")
        need(r.num_servers >= 1, "rollout.num_servers", r.num_servers, ">= 1")
        need(0 <= r.max_reward_error_fraction <= 1, "rollout.max_reward_error_fraction",
             r.max_reward_error_fraction, "in [0, 1]")
        for url in r.server_urls:
            need(url.startswith(("http://", "https://")), "rollout.server_urls", url,
                 "URLs like http://host:port")
        need(not r.mask_stale_tokens or r.partial_rollouts, "rollout.mask_stale_tokens",
             r.mask_stale_tokens, "false unless rollout.partial_rollouts is true")
        need(t.steps >= 0, "train.steps", t.steps, ">= 0")
        need(t.mini_batches >= 1, "train.mini_batches", t.mini_batches, ">= 1")
        batch = r.group_size * r.prompts_per_step
        need(batch % t.mini_batches == 0, "train.mini_batches", t.mini_batches,
             f"a divisor of the rollout batch ({r.prompts_per_step} prompts x {r.group_size} = "
             f"{batch} responses)")
        need(t.micro_batch_size >= 1, "train.micro_batch_size", t.micro_batch_size, ">= 1")
        need(t.lr >= 0, "train.lr", t.lr, ">= 0")
        need(t.clip_grad >= 0, "train.clip_grad", t.clip_grad, ">= 0")
        need(t.warm_start_steps >= 0, "train.warm_start_steps", t.warm_start_steps, ">= 0")
        need(t.warm_start_batch_size >= 1, "train.warm_start_batch_size", t.warm_start_batch_size,
             ">= 1")
        lo, hi = l.clip_range()
        need(0 <= lo < 1, "loss.eps_low", lo, "in [0, 1)")
        need(hi >= 0, "loss.eps_high", hi, ">= 0")
        need(l.kl_coef >= 0, "loss.kl_coef", l.kl_coef, ">= 0")
        need(c.interval >= 1, "checkpoint.interval", c.interval, ">= 1")
        need(c.keep >= 0, "checkpoint.keep", c.keep, ">= 0")
        need(self.sync.bucket_mb >= 1, "sync.bucket_mb", self.sync.bucket_mb, ">= 1")


# --- parsing -------------------------------------------------------------------------------------
def _type_name(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if get_origin(tp) in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(tp))
    if get_origin(tp) is list:
        return f"list[{_type_name(get_args(tp)[0])}]"
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, field: str) -> Any:
    """`value` as type `tp`, or ConfigError naming the field, the value and the expected type."""
    origin = get_origin(tp)
    bad = ConfigError(f"{field}={value!r}: expected {_type_name(tp)}")
    if origin in (typing.Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, field)
            except ConfigError:
                pass
        raise bad
    if origin is Literal:
        if value in get_args(tp):
            return value
        raise bad
    if origin is list:
        if isinstance(value, str):  # `--set a=x` for a one-element list
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise bad
        return [_coerce(v, get_args(tp)[0], f"{field}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise bad
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise bad
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-6" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                raise bad from None
        raise bad
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise bad
    raise bad


def _section_types(cls: type) -> dict[str, Any]:
    return get_type_hints(cls, globalns=vars(typing) | globals())


def _unknown(key: str, known: list[str], where: str) -> ConfigError:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ConfigError(f"unknown key '{where}{key}'{hint}; known: {', '.join(known)}")


def _build(cls: type, data: Any, prefix: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    hints = _section_types(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            raise _unknown(str(key), names, prefix)
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value, f"{prefix}{key}.")
        else:
            kwargs[key] = _coerce(value, tp, f"{prefix}{key}")
    return cls(**kwargs)


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b=c` -> (["a", "b"], value parsed as YAML: ints, floats, bools, lists, null)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected KEY=VALUE, e.g. train.steps=3")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not p for p in key.split(".")):
        raise ConfigError(f"override {text!r}: bad key {key!r}")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {text!r}: value is not valid YAML ({e})") from None
    return key.split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for part in path[:-1]:
            if not isinstance(node.get(part, {}), dict):
                raise ConfigError(f"override {text!r}: {part!r} is not a section")
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return data


def config_from_dict(data: dict[str, Any], overrides: list[str] | None = None) -> RunConfig:
    data = apply_overrides(copy.deepcopy(dict(data or {})), list(overrides or []))
    cfg = _build(RunConfig, data, "")
    cfg.validate()
    return cfg


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> RunConfig:
    """Read a YAML config (None: defaults only), apply `a.b=c` overrides, validate.

    Relative paths in the file (model.hf_path, rollout.prompts) stay relative to the working
    directory, as the user typed them."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {str(p)!r} is not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {str(p)!r}: expected a mapping of sections, got "
                              f"{type(data).__name__}")
    return config_from_dict(data, overrides)


# --- documentation -------------------------------------------------------------------------------
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a config dataclass (read from the source, as Sphinx does)."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for a, b in zip(body, body[1:]):
        if (isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name)
                and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant)
                and isinstance(b.value.value, str)):
            docs[a.target.id] = " ".join(b.value.value.split())
    return docs


def describe_fields() -> str:
    """Every field: `section.name (type, default) docstring` — `gspo-megatron config`."""
    lines = []
    top_docs = field_docs(RunConfig)
    defaults = RunConfig()
    for sect in dataclasses.fields(RunConfig):
        cls = _section_types(RunConfig)[sect.name]
        lines.append(f"{sect.name}:  # {top_docs.get(sect.name, '')}")
        docs, hints = field_docs(cls), _section_types(cls)
        for f in dataclasses.fields(cls):
            default = getattr(getattr(defaults, sect.name), f.name)
            lines.append(f"  {f.name}: {default!r}  # ({_type_name(hints[f.name])}) "
                         f"{docs.get(f.name, '')}")
    return "\n".join(lines)
