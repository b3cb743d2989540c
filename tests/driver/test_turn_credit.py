"""Multi-turn pieces of the trainer that need no server: per-turn credit (driver/turn_credit.py's
rule on a hand-computed episode), the chat template's environment tokens, the environment registry and its
errors, scripted warm-start episodes."""
from __future__ import annotations


import pytest
import torch
import transformers

from fixtures_models import tiny_model_dir
from gspo_megatron.algorithms.advantage.pipeline import BatchRows, batch_advantages
from gspo_megatron.algorithms.advantage.table import AdvantageSettings
from gspo_megatron.driver.turn_credit import turn_credit_advantages
from gspo_megatron.driver.warm_start import demonstration
from rollout.generation.multiturn.chat import ChatTemplate
from rollout.envs import CalculatorEnv, EnvironmentSpecError, environment_class
from rollout.generation.sample import Sample


def _episode(index: int, turns: list[int], rewards: list[float], prompt: int = 3) -> Sample:
    """An episode of model turns of these lengths, an environment turn of 2 tokens after each."""
    s = Sample(0, index, {}, [7] * prompt, 20)
    spans: list[tuple[str, int, int]] = []
    at = 0
    for k, n in enumerate(turns):
        spans.append(("model", at, at + n))
        at += n
        if k < len(turns) - 1:
            spans.append(("env", at, at + 2))
            at += 2
    s.response_ids = list(range(at))
    s.loss_mask = [int(kind == "model") for kind, a, b in spans for _ in range(a, b)]
    s.metadata = {"spans": [list(span) for span in spans], "turn_rewards": rewards}
    return s


def test_token_advantages_hand_computed_follow_the_model_spans():
    # a group of two episodes; rewards after each model turn; discount 0.5
    # ep 0: r = [0, 1, 2] -> G = [0 + 0.5*1 + 0.25*2, 1 + 0.5*2, 2] = [1.0, 2.0, 2.0]
    # ep 1: r = [3]       -> G = [3.0]
    # grpo over G_{.,1} = [1, 3]: mean 2, std 1 -> A = (G - 2) / (1 + 1e-6)
    s, other = _episode(0, [2, 3, 1], [0.0, 1.0, 2.0]), _episode(1, [2], [3.0], prompt=1)
    adv = turn_credit_advantages([s, other], group_size=2, width=16, discount=0.5)
    scale = 1 + 1e-6
    p = 3
    assert adv[0, :p].tolist() == [0.0] * p
    assert torch.allclose(adv[0, p:p + 2], torch.tensor(-1.0 / scale))
    assert adv[0, p + 2:p + 4].tolist() == [0.0, 0.0]          # environment tokens
    assert torch.allclose(adv[0, p + 4:p + 7], torch.tensor(0.0))
    assert adv[0, p + 7:p + 9].tolist() == [0.0, 0.0]
    assert torch.allclose(adv[0, p + 9:p + 10], torch.tensor(0.0))
    assert torch.allclose(adv[1, 1:3], torch.tensor(1.0 / scale)) and adv[1, 3:].abs().sum() == 0
    # equal episode returns: zero everywhere (no NaN)
    equal = turn_credit_advantages([_episode(0, [1, 1], [1.0, 0.0]), _episode(1, [1, 1], [0.0, 1.0])], 2, None, 1.0)
    assert equal.tolist() == [0.0] * equal.numel()


def test_final_reward_only_equals_gspo_advantages():
    """One reward at the end of each episode and discount 1: G_{i,k} = R_i for every turn, so
    every token of an episode gets the episode's GSPO advantage."""
    rewards = [[0.0, 0.0, 1.0], [0.0, 0.0], [0.0, 0.0, 0.0, 0.5], [1.0]]
    episodes = [_episode(i, [2] * len(r), r) for i, r in enumerate(rewards)]
    adv = turn_credit_advantages(episodes, group_size=4, width=None, discount=1.0)
    rows = BatchRows(torch.tensor([1] * 4), torch.ones(4, dtype=torch.bool), torch.zeros(4, dtype=torch.long), 1)
    seq, _ = batch_advantages(AdvantageSettings(), torch.tensor([sum(r) for r in rewards]), rows)
    mask = torch.cat([torch.tensor([0] * 3 + e.loss_mask, dtype=torch.bool) for e in episodes])
    per_token = torch.repeat_interleave(seq.float(), torch.tensor([3 + len(e.response_ids) for e in episodes]))
    assert torch.allclose(adv[mask], per_token[mask]) and adv[~mask].abs().sum() == 0
    assert seq.abs().sum() > 0


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(tiny_model_dir("qwen3_moe", 0))


def test_chat_template_environment_tokens(tokenizer):
    chat = ChatTemplate(tokenizer)
    assert not chat.has_tool_role  # the tiny model's template has no tool role: "user"
    closed = tokenizer.decode(chat.observation_ids("obs", role="user", model_turn_closed=True))
    cut = tokenizer.decode(chat.observation_ids("obs", role="user", model_turn_closed=False))
    assert closed == "\n<|im_start|>user\nobs<|im_end|>\n<|im_start|>assistant\n"
    assert cut == "<|im_end|>" + closed  # a turn cut by its budget gets its closing from the template
    first = tokenizer.decode(chat.first_prompt_ids("What is 1+1?"))
    assert first == "<|im_start|>user\nWhat is 1+1?<|im_end|>\n<|im_start|>assistant\n"


def test_tool_role_where_the_template_has_one(tokenizer):
    import copy
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = tokenizer.chat_template.replace(
        "{% for message in messages %}", "{% for message in messages %}{# tool messages too #}")
    chat = ChatTemplate(tok)
    assert chat.has_tool_role and chat.role_for(tool_response=True) == "tool"
    text = tok.decode(chat.observation_ids("<tool_response>2</tool_response>", role="tool",
                                           model_turn_closed=True))
    assert text == "\n<|im_start|>tool\n<tool_response>2</tool_response><|im_end|>\n<|im_start|>assistant\n"


def test_demonstration_is_the_episode_rl_would_build(tokenizer):
    chat = ChatTemplate(tokenizer)
    rec = {"prompt": "What is 3+4?", "answer": "7", "solution": ["<tool_call>3+4</tool_call>", "\\boxed{7}"]}
    prompt, response, mask = demonstration(rec, CalculatorEnv(), chat, tokenizer)
    eos = tokenizer.eos_token_id
    turn1 = tokenizer.encode("<tool_call>3+4</tool_call>", add_special_tokens=False) + [eos]
    obs = chat.observation_ids("<tool_response>7</tool_response>", role="user", model_turn_closed=True)
    turn2 = tokenizer.encode("\\boxed{7}", add_special_tokens=False) + [eos]
    assert response == turn1 + obs + turn2
    assert mask == [1] * len(turn1) + [0] * len(obs) + [1] * len(turn2)
    with pytest.raises(ValueError, match="'solution' as a list of assistant turns"):
        demonstration({**rec, "solution": "\\boxed{7}"}, CalculatorEnv(), chat, tokenizer)


class NotAnEnv:
    pass


@pytest.mark.parametrize("spec,needle", [
    ("calculatr", "expected one of calculator, guessing, or package.module:Name naming a class with reset() and step()"),
    ("no_such_module_xyz:Env", "cannot import 'no_such_module_xyz' (ModuleNotFoundError"),
    ("rollout.envs.calculator:Nope", "module 'rollout.envs.calculator' has no 'Nope'"),
    ("test_turn_credit:NotAnEnv", "'NotAnEnv' is not an environment class (needs reset() and step()"),
])
def test_bad_environment_names_are_named(spec, needle):
    with pytest.raises(EnvironmentSpecError, match=None) as e:
        environment_class(spec)
    assert needle in str(e.value) and repr(spec) in str(e.value)
    assert environment_class("calculator") is CalculatorEnv
    assert environment_class("rollout.envs.guessing:GuessingGameEnv").__name__ == "GuessingGameEnv"
