"""Multi-turn episodes: environments (fast) and token-in/token-out assembly on a real server (slow)."""
from __future__ import annotations

import threading

import pytest
import transformers

from fixtures_models import tiny_model_dir
from rollout.servers.pool import ServerPool
from rollout.envs import CalculatorEnv, GuessingGameEnv
from rollout.envs.calculator import safe_eval
from rollout.generation.manager import ManagerConfig, RolloutManager
from rollout.generation.multiturn import ChatFormat


def test_calculator_env():
    env = CalculatorEnv(max_turns=3)
    assert "calculator" in env.reset({"prompt": "What is 12*7+3?", "answer": "87"})
    step = env.step("let me compute <tool_call>12*7+3</tool_call>")
    assert step.observation == "<tool_response>87</tool_response>" and not step.done and step.reward == 0
    assert "error" in env.step("<tool_call>__import__('os')</tool_call>").observation
    assert "No tool call" in env.step("hmm").observation
    assert env.step("so \\boxed{87}").reward == 1.0 and env.step("\\boxed{86}").done
    assert safe_eval("(1+2)*3/4") == 2.25
    with pytest.raises(ValueError):
        safe_eval("open('x')")


def test_guessing_env():
    env = GuessingGameEnv()
    env.reset({"prompt": "", "answer": "37"})
    assert env.step("I guess 50").observation == "lower"
    assert env.step("20").observation == "higher"
    assert env.step("no idea").observation.startswith("invalid")
    step = env.step("is it 37?")
    assert step.done and step.reward == 1.0


class _RecordingPool:
    """The real ServerPool, recording exactly what each /generate returned (a spy, not a double)."""

    def __init__(self, pool):
        self.pool, self.outputs, self.lock = pool, {}, threading.Lock()

    def generate(self, input_ids, sampling_params, *, rid=None, timeout_s=None, abandon=None):
        out = self.pool.generate(input_ids, sampling_params, rid=rid, timeout_s=timeout_s,
                                 abandon=abandon)
        with self.lock:
            self.outputs.setdefault(rid.rsplit("-", 1)[0], []).append(
                (list(input_ids), out))
        return out

    def abort_all(self):
        self.pool.abort_all()


@pytest.mark.slow
@pytest.mark.parametrize("env_cls", [CalculatorEnv, GuessingGameEnv])
def test_episode_token_in_token_out(qwen3_server, env_cls):
    tok = transformers.AutoTokenizer.from_pretrained(tiny_model_dir("qwen3", 0))
    pool = _RecordingPool(ServerPool(qwen3_server.server_urls))
    encode_calls = []

    def encode_text(text):
        encode_calls.append(text)
        return tok.encode(text, add_special_tokens=False)

    budget = 120
    cfg = ManagerConfig(group_size=3, max_new_tokens=budget, max_turn_tokens=16)
    mgr = RolloutManager(pool, cfg, decode=tok.decode, env_factory=lambda rec: env_cls(max_turns=4),
                         encode_text=encode_text)
    records = [{"prompt": "What is 6*7?", "answer": "42"}, {"prompt": "Guess.", "answer": "7"}]
    result = mgr.generate_step(iter(records), num_groups=2)
    chat = ChatFormat()
    model_texts = set()
    for g in result.groups:
        for s in g:
            s.check_aligned()
            assert s.status == "done" and s.reward is not None and len(s.response_ids) <= budget
            replies = pool.outputs[f"{mgr.requests.run_tag}-{s.group_id}-{s.index}"]
            spans = s.metadata["spans"]
            assert [k for k, _, _ in spans] == (["model", "env"] * len(spans))[:len(spans)]
            assert len([k for k, _, _ in spans if k == "model"]) == len(replies) == s.metadata["turns"]
            # rebuild: each model span is exactly a server reply's ids and log-probs, sent with
            # exactly the sequence built so far; every env span is mask 0 without log-prob
            models = iter(replies)
            for kind, a, b in spans:
                if kind == "model":
                    sent, out = next(models)
                    assert sent == s.prompt_ids + s.response_ids[:a]
                    assert s.response_ids[a:b] == out.output_ids
                    assert s.logprobs[a:b] == out.logprobs and s.loss_mask[a:b] == [1] * (b - a)
                    assert s.weight_versions[a:b] == out.weight_versions
                    model_texts.add(tok.decode(out.output_ids[:-1] if out.finish_reason == "stop"
                                               else out.output_ids))
                else:
                    assert s.loss_mask[a:b] == [0] * (b - a) and s.logprobs[a:b] == [0.0] * (b - a)
                    assert s.weight_versions[a:b] == [""] * (b - a)
                    text = tok.decode(s.response_ids[a:b])
                    assert text.endswith(chat.assistant_prefix) and chat.user_prefix in text
            assert spans[-1][2] == len(s.response_ids)
    # only prompts and environment observations were ever tokenised, never the model's text
    assert not model_texts & set(encode_calls)
    assert all(chat.user_prefix in t for t in encode_calls)
