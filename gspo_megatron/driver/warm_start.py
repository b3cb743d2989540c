"""The supervised warm start's examples and rows (train.warm_start_steps): a few cross-entropy
steps on the prompt set's answers teach a tiny random model the answer format before RL.

    examples = warm_start_examples(records, n=32, offset=0, tokenizer=tok)   # (prompt, answer, mask)
    batch = sft_batch(examples)                                              # padded TrainBatch

Without an environment an example is the record's solution (else its answer) + EOS as the
assistant's reply; with one, the record's scripted turns played against the environment
(demonstration), tokenised exactly as rollouts are.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from gspo_megatron.actor.batching.batch import TrainBatch
from rollout.generation.multiturn import Environment, EpisodeChat
from rollout.prompts.dataset import chat_prompt_ids


def warm_start_examples(records: Sequence[dict], n: int, offset: int, tokenizer: Any,
                        env_factory: Callable[[dict], Environment] | None = None,
                        chat: EpisodeChat | None = None,
                        ) -> list[tuple[list[int], list[int], list[int]]]:
    """n (prompt ids, response ids, response loss mask), cycling through `records` from `offset`."""
    out = []
    for k in range(n):
        rec = records[(offset + k) % len(records)]
        if env_factory is not None:
            if chat is None:
                raise ValueError("a multi-turn warm start needs the chat template its episodes use")
            out.append(demonstration(rec, env_factory(rec), chat, tokenizer))
            continue
        eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
        if eos is None or eos < 0:
            eos = tokenizer.eos_token_id
        answer = rec.get("solution", rec["answer"])
        ids = tokenizer.encode(str(answer), add_special_tokens=False) + [int(eos)]
        out.append((chat_prompt_ids(tokenizer, rec), ids, [1] * len(ids)))
    return out


def demonstration(record: dict, env: Environment, chat: EpisodeChat, tokenizer: Any) -> tuple[list[int], list[int], list[int]]:
    """A scripted episode for the supervised warm start: record["solution"] lists the assistant's
    turns; they are played against the environment through the chat template exactly as rollouts
    are built (each turn's text + EOS, then the environment's tokens), so the warm start teaches
    the same token sequences RL will sample. Returns (prompt ids, response ids, loss mask)."""
    turns = record.get("solution")
    if not isinstance(turns, list) or not all(isinstance(t, str) for t in turns):
        raise ValueError(f"a multi-turn warm start needs the record's 'solution' as a list of "
                         f"assistant turns, got {turns!r:.80}")
    eos = int(tokenizer.eos_token_id)
    prompt = chat.first_prompt_ids(env.reset(record))
    response, mask = [], []
    for k, text in enumerate(turns):
        ids = [int(t) for t in tokenizer.encode(text, add_special_tokens=False)] + [eos]
        response += ids
        mask += [1] * len(ids)
        step = env.step(text)
        if step.done or k == len(turns) - 1:
            break
        obs = chat.observation_ids(step.observation, role=chat.role_for(step.tool_call),
                                   model_turn_closed=True)
        response += obs
        mask += [0] * len(obs)
    return prompt, response, mask


def sft_batch(examples: list[tuple]) -> TrainBatch:
    """Prompt + answer rows with loss on the answer tokens (the "ce" loss of the actor). An
    example is (prompt ids, answer ids) or (prompt ids, answer ids, answer loss mask): an episode's
    environment tokens are in the row but not trained."""
    width = max(len(e[0]) + len(e[1]) for e in examples)
    b = len(examples)
    tokens = torch.zeros(b, width, dtype=torch.long)
    loss_mask = torch.zeros(b, width, dtype=torch.bool)
    lengths = torch.zeros(b, dtype=torch.long)
    for i, e in enumerate(examples):
        p, a = e[0], e[1]
        mask = e[2] if len(e) > 2 else [1] * len(a)
        tokens[i, :len(p) + len(a)] = torch.tensor(p + a)
        loss_mask[i, len(p):len(p) + len(a)] = torch.tensor(mask, dtype=torch.bool)
        lengths[i] = len(p) + len(a)
    return TrainBatch(tokens=tokens, lengths=lengths, loss_mask=loss_mask,
                      advantages=torch.zeros(b))
