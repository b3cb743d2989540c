"""Whether a sample's per-token records are paired: the check that GSPO's and GRPO's importance
ratios (and routing replay) rely on, for samples built from several generate calls (partial
rollouts resumed in a later step, multi-turn episodes, requests aborted or retracted and resumed,
asynchronous rollouts).

    problem = misalignment(sample)      # None, or what is wrong at the first misaligned position

A sample is paired when (rollout/generation/sample.py has the layout):
- response ids, engine log-probs, loss mask and weight versions have one entry per response token,
  and the routes (when recorded) one row per token of prompt + response;
- every model token (a weight version) has a finite log-prob <= 0; an environment token (version
  "") is never trained and has log-prob 0;
- the versions never go back along the response (where they are the trainer's step numbers): a
  token is never sampled by older weights than a token before it;
- every input position whose next token the model sampled has a route (all of its top-k ids), and
  the final position, which no forward pass read, has none.
Which experts a route names against the weights of its token's version needs the model: the
trainer measures that (routing/version_mismatch, gspo_megatron/actor/actor.py).

Cost: a few numpy passes over the sample's tokens and routes (the driver checks a few samples per
step, rollout/alignment_*; the tests check every sample they make).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from rollout.generation.sample import Sample


def misalignment(sample: Sample) -> str | None:
    """None when `sample`'s records are paired (module docstring), else a line naming the first
    misaligned response position (its input position in prompt + response too) and what is wrong."""
    n, prompt = len(sample.response_ids), len(sample.prompt_ids)
    fields: dict[str, list] = {"log-probs": sample.logprobs, "loss-mask entries": sample.loss_mask,
                               "weight versions": sample.weight_versions}
    short = {name: len(v) for name, v in fields.items() if len(v) != n}
    if short:
        name, got = min(short.items(), key=lambda kv: kv[1])
        return (f"response position {min(got, n)}: {n} response ids but {got} {name} "
                f"(lengths {', '.join(f'{k} {len(v)}' for k, v in fields.items())})")
    routes = sample.routed_experts
    if routes is not None and len(routes) != prompt + n:
        return (f"{prompt + n} tokens (prompt {prompt} + response {n}) but {len(routes)} "
                f"routed-experts rows")
    versions = sample.weight_versions
    model = np.array([v != "" for v in versions], dtype=bool)
    trained = np.array(sample.loss_mask, dtype=bool)
    logp = np.array(sample.logprobs, dtype=np.float64)
    problems: list[tuple[int, str]] = []

    def first(bad: np.ndarray, what) -> None:
        where = np.flatnonzero(bad)
        if where.size:
            problems.append((int(where[0]), what(int(where[0]))))

    first(~model & trained, lambda t: "an environment token (no weight version) is trained")
    first(~model & (logp != 0.0), lambda t: f"an environment token has log-prob {logp[t]} (expected 0)")
    first(model & ~(np.isfinite(logp) & (logp <= 1e-6)),
          lambda t: f"model token {sample.response_ids[t]} has log-prob {logp[t]} (expected finite, <= 0)")
    numbers = [(t, int(v)) for t, v in enumerate(versions) if v.isdigit()]
    back = [t for (_, a), (t, b) in zip(numbers, numbers[1:]) if b < a]
    if back:
        t = back[0]
        earlier = max(int(v) for v in versions[:t] if v.isdigit())
        problems.append((t, f"weight version {versions[t]} after a token of version {earlier}"))
    if routes is not None and n:
        routed = np.all(np.asarray(routes) >= 0, axis=(1, 2)).reshape(-1)  # [prompt + n]
        # input position prompt + t - 1 is where the model read the token before response token t
        pos = prompt - 1 + np.arange(n)
        has = np.zeros(n, dtype=bool)
        has[pos >= 0] = routed[pos[pos >= 0]]
        first(model & (pos >= 0) & ~has,
              lambda t: f"no route at input position {prompt + t - 1}, whose next token (model "
                        f"token {sample.response_ids[t]}, version {versions[t]}) was sampled")
        if (np.asarray(routes[-1]) >= 0).any():
            problems.append((n - 1, f"a route at the final input position {prompt + n - 1}, which "
                                    f"no forward pass read: routes shifted against the tokens?"))
    if not problems:
        return None
    t, what = min(problems, key=lambda p: p[0])
    return f"response position {t} (sequence position {prompt + t}): {what}"
