"""tools/make_counting_task.py: the long-response task of benchmarks/moe_stability.py. Deterministic,
a held-out split no training prompt falls in, answers that follow from the worked-out steps, the
promised lengths in the tiny models' tokens, and a warm start (the trainer's own examples and rows)
that teaches the format."""
from __future__ import annotations

import json
import re
import statistics

import pytest
import torch
import transformers

from fixtures_models import tiny_model_dir
from gspo_megatron.driver.warm_start import sft_batch, warm_start_examples
from rollout.prompts.dataset import chat_prompt_ids
from rollout.rewards import exact_match_reward
from tools.make_counting_task import make_counting_task, terms

FORMAT = re.compile(r"(\d+ - \d+ = \d+, )*\d+ - \d+ = \d+\. \\boxed\{\d+\}")


def _rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_task_is_deterministic_and_its_split_holds_out_every_eval_prompt(tmp_path):
    a, b, c = (make_counting_task(tmp_path / name, seed=seed) for name, seed in (("a", 0), ("b", 0), ("c", 1)))
    assert a["train"].read_bytes() == b["train"].read_bytes()
    assert a["eval"].read_bytes() == c["eval"].read_bytes()  # the split does not depend on the order
    train, held_out = _rows(a["train"]), _rows(a["eval"])
    assert [r["prompt"] for r in _rows(c["train"])] != [r["prompt"] for r in train]  # the seed's order
    assert sorted(map(json.dumps, _rows(c["train"]))) == sorted(map(json.dumps, train))
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
    assert 0.07 < len(held_out) / (len(train) + len(held_out)) < 0.13


def test_every_answer_is_the_last_worked_out_term(tmp_path):
    rows = _rows(make_counting_task(tmp_path)["train"])
    for r in rows:
        a, k = map(int, re.fullmatch(r"Count down from (\d+) in steps of (\d+)\.", r["prompt"]).groups())
        seq = terms(a, k)
        assert seq[0] == a and 0 <= seq[-1] < k and all(x - y == k for x, y in zip(seq, seq[1:]))
        assert FORMAT.fullmatch(r["solution"]) and r["answer"] == str(a % k)
        steps = re.findall(r"(\d+) - (\d+) = (\d+)", r["solution"])  # every step is right
        assert all(int(x) - int(d) == int(y) and int(d) == k for x, d, y in steps) and len(steps) == len(seq) - 1
        assert exact_match_reward(r, r["solution"]) == 1.0
    r = rows[0]
    off_by_one = r["solution"].replace(f"{{{r['answer']}}}", f"{{{int(r['answer']) + 1}}}")
    assert exact_match_reward(r, off_by_one) == 0.0


def test_responses_are_long_in_the_tiny_models_tokens(tmp_path):
    tok = transformers.AutoTokenizer.from_pretrained(tiny_model_dir("qwen3_moe", 0))
    lengths = [len(tok.encode(r["solution"], add_special_tokens=False)) + 1
               for r in _rows(make_counting_task(tmp_path)["train"])]
    assert statistics.fmean(lengths) >= 64 and sum(n > 200 for n in lengths) >= 10, (
        statistics.fmean(lengths), max(lengths))


@pytest.mark.slow
def test_the_warm_start_teaches_the_format(tmp_path):
    """The trainer's warm-start examples and rows (driver/warm_start.py), 80 cross-entropy steps of
    16 on the tiny MoE with transformers (about 10 s), then greedy answers to the 8 shortest
    held-out prompts: the worked-out format, ending in a boxed number (7 of 8 here)."""
    paths = make_counting_task(tmp_path)
    src = tiny_model_dir("qwen3_moe", 0)
    tok = transformers.AutoTokenizer.from_pretrained(src)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    records = _rows(paths["train"])
    for k in range(80):
        batch = sft_batch(warm_start_examples(records, 16, offset=16 * k, tokenizer=tok))
        mask = torch.arange(batch.tokens.shape[1])[None] < batch.lengths[:, None]
        loss = model(input_ids=batch.tokens, attention_mask=mask.long(),
                     labels=batch.tokens.masked_fill(~batch.loss_mask, -100)).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    formatted = 0
    for r in sorted(_rows(paths["eval"]), key=lambda r: len(r["solution"]))[:8]:
        ids = torch.tensor([chat_prompt_ids(tok, r)])
        out = model.generate(ids, max_new_tokens=128, do_sample=False,
                             eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"))
        text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        formatted += bool(FORMAT.fullmatch(text.strip()))
    assert loss.item() < 1.0 and formatted >= 6, (loss.item(), formatted)
