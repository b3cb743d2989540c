"""Multi-turn pieces of the trainer that need no server: per-turn credit (the documented rule on a
hand-computed episode), the chat template's environment tokens, the environment registry and its
errors, scripted warm-start episodes."""
from __future__ import annotations

import math

import pytest
import torch
import transformers

from fixtures_models import tiny_model_dir
from gspo_megatron.algorithms.advantages import group_advantages, turn_advantages
from gspo_megatron.driver.turn_credit import turn_credit_advantages
from gspo_megatron.driver.warm_start import demonstration
from rollout.generation.chat import ChatTemplate
from rollout.envs import CalculatorEnv, EnvironmentSpecError, environment_class
from rollout.generation.sample import Sample


def test_turn_advantages_hand_computed():
    # a group of two episodes; rewards after each model turn; discount 0.5
    # ep 0: r = [0, 1, 2] -> G = [0 + 0.5*1 + 0.25*2, 1 + 0.5*2, 2] = [1.0, 2.0, 2.0]
    # ep 1: r = [3]       -> G = [3.0]
    # group over G_{.,1} = [1, 3]: mean 2, std 1 -> A = (G - 2) / (1 + eps)
    adv = turn_advantages([[0.0, 1.0, 2.0], [3.0]], group_size=2, discount=0.5, eps=0.0)
    assert adv == [[-1.0, 0.0, 0.0], [1.0]]
    # equal episode returns: zero everywhere (no NaN), like group_advantages
    assert turn_advantages([[1.0, 0.0], [0.0, 1.0]], 2) == [[0.0, 0.0], [0.0, 0.0]]


def test_final_reward_only_equals_gspo_advantages():
    rewards = [[0.0, 0.0, 1.0], [0.0, 0.0], [0.0, 0.0, 0.0, 0.5], [1.0]]
    adv = turn_advantages(rewards, group_size=4)
    seq = group_advantages(torch.tensor([sum(r) for r in rewards]), 4).tolist()
    for turns, a in zip(adv, seq):
        assert all(math.isclose(t, a, rel_tol=1e-6, abs_tol=1e-9) for t in turns)


def test_token_advantages_follow_the_model_spans():
    s = Sample(0, 0, {}, [7, 7, 7], 20)
    s.response_ids = list(range(9))
    s.loss_mask = [1, 1, 0, 0, 1, 1, 1, 0, 1]
    s.metadata = {"spans": [["model", 0, 2], ["env", 2, 4], ["model", 4, 7], ["env", 7, 8], ["model", 8, 9]],
                  "turn_rewards": [0.0, 1.0, 2.0]}
    other = Sample(0, 1, {}, [7], 20)
    other.response_ids, other.loss_mask = [1, 2], [1, 1]
    other.metadata = {"spans": [["model", 0, 2]], "turn_rewards": [3.0]}
    adv = turn_credit_advantages([s, other], group_size=2, width=12, discount=0.5)
    want = turn_advantages([[0.0, 1.0, 2.0], [3.0]], 2, 0.5)
    p = 3
    assert adv[0, :p].tolist() == [0.0] * p
    assert torch.allclose(adv[0, p:p + 2], torch.tensor(want[0][0]))
    assert adv[0, p + 2:p + 4].tolist() == [0.0, 0.0]          # environment tokens
    assert torch.allclose(adv[0, p + 4:p + 7], torch.tensor(want[0][1]))
    assert torch.allclose(adv[0, p + 8:p + 9], torch.tensor(want[0][2]))
    assert torch.allclose(adv[1, 1:3], torch.tensor(want[1][0])) and adv[1, 3:].abs().sum() == 0


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
