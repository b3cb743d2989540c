"""Prompt jsonl loading (errors name file and line), chat prompts, the resumable prompt stream,
and the Sample record (no server)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import transformers

from fixtures_models import tiny_model_dir
from rollout.in_server.cpu_stand_ins import STAND_INS_DIR
from rollout.prompts.dataset import PromptFileError, PromptStream, chat_prompt_ids, load_prompts
from rollout.generation.sample import Sample


def _write(tmp_path, lines):
    p = tmp_path / "prompts.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_load_prompts_ok(tmp_path):
    p = _write(tmp_path, [json.dumps({"prompt": "1+1?", "answer": "2"}), "",
                          json.dumps({"prompt": [{"role": "user", "content": "hi"}], "answer": 3})])
    assert [r["answer"] for r in load_prompts(p)] == ["2", 3]
    assert len(load_prompts(p)) == 2


@pytest.mark.parametrize("line,match", [
    ("{not json", r"prompts.jsonl:2: not valid JSON"),
    ("[1, 2]", r"prompts.jsonl:2: expected an object, got list"),
    (json.dumps({"prompt": "x"}), r"prompts.jsonl:2: no key 'answer' \(no 'answer'; the row has \['prompt'\]\)"),
    (json.dumps({"prompt": "", "answer": 1}), r"prompts.jsonl:2: 'prompt' must be"),
])
def test_load_prompts_errors_name_file_and_line(tmp_path, line, match):
    p = _write(tmp_path, [json.dumps({"prompt": "ok", "answer": "1"}), line])
    with pytest.raises(PromptFileError, match=match):
        load_prompts(p)
    with pytest.raises(PromptFileError, match="missing.jsonl': no such file or folder"):
        load_prompts(tmp_path / "missing.jsonl")


def test_chat_prompt_ids():
    tok = transformers.AutoTokenizer.from_pretrained(tiny_model_dir("qwen3", 0))
    ids = chat_prompt_ids(tok, {"prompt": "What is 2+2?"}, system="Be brief.")
    assert tok.decode(ids) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?"
                               "<|im_end|>\n<|im_start|>assistant\n")


def test_prompt_stream_epochs_and_resume():
    records = [{"i": i} for i in range(5)]
    a = PromptStream(records, seed=3)
    first = [next(a)["i"] for _ in range(7)]
    assert sorted(first[:5]) == list(range(5))
    state = a.to_state()
    rest = [next(a)["i"] for _ in range(6)]
    b = PromptStream(records, seed=3)
    b.load_state(state)
    assert [next(b)["i"] for _ in range(6)] == rest


def test_sample_arrays_and_roundtrip():
    s = Sample(7, 1, {"prompt": "p", "answer": "1"}, [1, 2], max_new_tokens=10)
    s.append_model_tokens([5, 6], [-0.1, -0.2], ["v1", "v1"])
    s.append_env_tokens([9])
    s.append_model_tokens([8], [-0.3], ["v2"])
    s.check_aligned()
    assert s.loss_mask == [1, 1, 0, 1] and s.logprobs[2] == 0.0 and s.remaining_tokens == 6
    assert s.tokens == [1, 2, 5, 6, 9, 8]
    assert Sample.from_dict(json.loads(json.dumps(s.to_dict()))) == s
    assert s.mask_stale_tokens("v2") == 2 and s.loss_mask == [0, 0, 0, 1]
    with pytest.raises(ValueError, match="misaligned"):
        s.append_model_tokens([1, 2], [0.0], ["v"])


def test_sgl_kernel_stand_in_raises_named_op():
    code = ("import sgl_kernel\nfrom sgl_kernel import silu_and_mul\n"
            "try:\n    silu_and_mul(1)\nexcept NotImplementedError as e:\n    print(e)\n"
            "try:\n    import sgl_kernel.flash_attn\nexcept ImportError:\n    print('no submodule')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={"PYTHONPATH": str(STAND_INS_DIR)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("sgl_kernel.silu_and_mul:") and "no submodule" in out.stdout
