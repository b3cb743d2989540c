"""Prompt data as users keep it (rollout/prompts/sets.py): verl's parquet, sharded parquet folders,
`datasets.save_to_disk` folders, slime-style jsonl with custom keys, lists of them; the long-prompt
filter; one-line errors naming file, row and key, before anything starts.

The files are real ones, written here with pyarrow and `datasets`; the runs are `gspo-megatron
train` against the session's SGLang server (tests/prompt_rewards.py holds a reward that depends on
the rows' data_source, to show it reaches the reward function).
"""
from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from fixtures_models import tiny_model_dir
from rollout.prompts.dataset import PromptFileError, PromptStream, load_prompts
from test_trainer_e2e import ROOT, base_overrides, env, run_train, server_url, train_cmd  # noqa: F401

CONFIG = "examples/tiny_moe_larger_digit.yaml"


def _rows(n: int, start: int = 0) -> list[dict]:
    """verl's layout: chat messages, the answer under reward_model, data_source, extra_info."""
    return [{"prompt": [{"role": "user", "content": f"({i}) Which is larger, {i % 10} or {(i * 7) % 10}?"}],
             "reward_model": {"ground_truth": str(max(i % 10, (i * 7) % 10)), "style": "rule"},
             "data_source": "alpha" if i % 2 else "beta", "extra_info": {"index": i}}
            for i in range(start, start + n)]


def verl_parquet(path: Path, n: int = 12, start: int = 0) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(_rows(n, start)), path)
    return path


def sharded(folder: Path, shards: int = 3, per: int = 4) -> Path:
    for k in range(shards):
        verl_parquet(folder / f"train-{k:05d}-of-{shards:05d}.parquet", per, k * per)
    return folder


def saved_to_disk(folder: Path, n: int = 8) -> Path:
    import datasets
    datasets.Dataset.from_list([{"question": f"What is {i} + 0?", "label": str(i), "data_source": "saved"}
                                for i in range(n)]).save_to_disk(str(folder))
    return folder


def slime_jsonl(path: Path, n: int = 6) -> Path:
    path.write_text("".join(json.dumps({"input": f"Say {i}.", "label": str(i), "metadata": {"i": i}}) + "\n"
                            for i in range(n)))
    return path


# --- loading -----------------------------------------------------------------------------------
def test_verl_parquet_rows_become_records(tmp_path):
    ps = load_prompts(verl_parquet(tmp_path / "train.parquet"), answer_key="reward_model.ground_truth",
                      cache_dir=tmp_path / "cache")
    assert len(ps) == 12
    rec = ps[3]
    assert rec["prompt"] == [{"role": "user", "content": "(3) Which is larger, 3 or 1?"}]
    assert rec["answer"] == "3" and rec["data_source"] == "alpha" and rec["extra_info"] == {"index": 3}
    assert list((tmp_path / "cache").glob("*.arrow"))  # memory-mapped from here, made once


def test_shards_save_to_disk_jsonl_and_lists(tmp_path):
    shards = load_prompts(sharded(tmp_path / "shards"), answer_key="reward_model.ground_truth")
    assert [r["extra_info"]["index"] for r in shards] == list(range(12))
    saved = load_prompts(saved_to_disk(tmp_path / "saved"), prompt_key="question", answer_key="label")
    assert len(saved) == 8 and saved[5]["prompt"] == "What is 5 + 0?" and saved[5]["answer"] == "5"
    slime = load_prompts(slime_jsonl(tmp_path / "s.jsonl"), prompt_key="input", answer_key="label")
    assert slime[2] == {"input": "Say 2.", "label": "2", "metadata": {"i": 2}, "prompt": "Say 2.", "answer": "2"}
    both = load_prompts([str(tmp_path / "s.jsonl"), str(tmp_path / "s.jsonl")], prompt_key="input",
                        answer_key="label")
    assert len(both) == 12 and both[7]["answer"] == "1"
    assert [f.name for f in shards.files()] == [f"train-{k:05d}-of-00003.parquet" for k in range(3)]


def test_a_large_set_is_not_read_whole(tmp_path):
    """The stream over a parquet set reads rows as it goes: its epoch order is an index list."""
    ps = load_prompts(verl_parquet(tmp_path / "big.parquet", 2000), answer_key="reward_model.ground_truth",
                      cache_dir=tmp_path / "cache")
    stream = PromptStream(ps, seed=1)
    first = [next(stream)["extra_info"]["index"] for _ in range(2000)]
    assert sorted(first) == list(range(2000))
    state = stream.to_state()
    again = PromptStream(ps, seed=1)
    again.load_state(state)
    assert next(again) == next(stream)


def test_long_prompt_filter_counts_and_keeps_the_rest(tmp_path):
    import transformers

    from rollout.prompts.dataset import chat_prompt_ids, filter_overlong
    tok = transformers.AutoTokenizer.from_pretrained(tiny_model_dir("qwen3_moe", 0))
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps({"prompt": "x " * n, "answer": "1"}) + "\n" for n in (1, 200, 2, 300, 3)))
    ps = load_prompts(path)
    limit = len(chat_prompt_ids(tok, ps[4])) + 1
    kept, dropped = filter_overlong(ps, tok, limit)
    assert dropped == 2 and [r["prompt"] for r in kept] == ["x ", "x x ", "x x x "]
    with pytest.raises(PromptFileError, match="every one of the 5 prompts is longer than 3 tokens"):
        filter_overlong(ps, tok, 3)


# --- bad input: one line, within seconds, nothing started ----------------------------------------
def _bad_inputs(tmp_path: Path) -> list[tuple[list[str], str]]:
    import pyarrow as pa
    import pyarrow.parquet as pq
    verl = verl_parquet(tmp_path / "verl.parquet")
    pq.write_table(pa.table({"prompt": [1, 2], "answer": ["1", "2"]}), tmp_path / "ints.parquet")
    (tmp_path / "junk.parquet").write_bytes(b"PAR1 not really")
    jsonl = tmp_path / "nokey.jsonl"
    jsonl.write_text(json.dumps({"question": "hi", "answer": "1"}) + "\n")
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt": "x " * 300, "answer": "1"}) + "\n")
    return [
        ([f"rollout.prompts={verl}"],
         f"rollout.prompts: {verl} row 0: no key 'answer' (no 'answer'; the rows have ['data_source', "
         "'extra_info', 'prompt', 'reward_model'])"),
        ([f"rollout.prompts={verl}", "rollout.answer_key=reward_model.truth"],
         f"rollout.prompts: {verl} row 0: no key 'reward_model.truth' (no 'truth' in 'reward_model'; it has "
         "['ground_truth', 'style'])"),
        ([f"rollout.prompts={jsonl}"],
         f"rollout.prompts: {jsonl}:1: no key 'prompt' (no 'prompt'; the row has ['answer', 'question'])"),
        ([f"rollout.prompts={tmp_path / 'ints.parquet'}"],
         f"rollout.prompts: {tmp_path / 'ints.parquet'} row 0: 'prompt' must be a string or a list of "
         "{'role', 'content'} messages, the column is int64"),
        ([f"rollout.prompts={tmp_path / 'junk.parquet'}"],
         f"rollout.prompts: {tmp_path / 'junk.parquet'}: not a readable parquet file (ArrowInvalid: "),
        (["rollout.prompts=openai/gsm8k"],
         f"rollout.prompts: 'openai/gsm8k' (= {ROOT / 'openai' / 'gsm8k'}, relative to the working directory): "
         "no such file or folder (it looks like a Hugging Face hub name: this machine has no hub access; "
         "download the dataset and give its local path)"),
        ([f"rollout.prompts={long}", "rollout.max_prompt_tokens=16"],
         f"rollout.prompts={str(long)!r}: every one of the 1 prompts is longer than 16 tokens"),
        ([f"eval.prompts={verl}", "eval.interval=5", "eval.answer_key=nope"],
         f"eval.prompts: {verl} row 0: no key 'nope'"),
        (["rollout.reward=no_such_module:fn"], "rollout.reward='no_such_module:fn': cannot import 'no_such_module' (ModuleNotFoundError"),
    ]


def test_bad_prompt_inputs_are_one_line_before_anything_starts(tmp_path, capsys):
    from gspo_megatron.cli import main
    hf = str(tiny_model_dir("qwen3_moe", 0))
    for sets, needle in _bad_inputs(tmp_path):
        t0 = time.perf_counter()
        argv = ["train", CONFIG, "--set", f"model.hf_path={hf}", "--set", f"checkpoint.dir={tmp_path / 'ck'}",
                "--set", f"logging.tensorboard_dir={tmp_path / 'tb'}", *[a for s in sets for a in ("--set", s)]]
        assert main(argv) == 2, sets
        err = capsys.readouterr().err
        lines = [ln for ln in err.splitlines() if ln.startswith("gspo-megatron: error")]
        assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
        assert needle in lines[0], (needle, lines[0])
        assert time.perf_counter() - t0 < 20, sets
        assert not (tmp_path / "ck").exists() and not (tmp_path / "tb").exists(), sets


# --- real runs ---------------------------------------------------------------------------------
def _run(tmp_path: Path, url: str, **sets):
    return run_train([CONFIG, *base_overrides(tmp_path, url, **{
        "train.steps": 1, "train.warm_start_steps": 0, "rollout.reward": "prompt_rewards:by_source",
        "logging.rollout_records": str(tmp_path / "records.jsonl"), **sets})])


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run_dir / "records.jsonl").read_text().splitlines()]


@pytest.mark.slow
# Two real runs: a folder of verl parquet shards and an Arrow save_to_disk folder with its own keys
# (prompt_key, answer_key). The single verl parquet file trains in the resume test below, JSONL in
# every other run; all four loaders (slime's JSONL keys too) are proven row by row above.
@pytest.mark.parametrize("kind", ["shards", "saved"])
def test_each_format_trains_a_step_and_the_reward_sees_data_source(tmp_path, server_url, kind):  # noqa: F811
    sets = {"shards": lambda: {"rollout.prompts": sharded(tmp_path / "d"),
                               "rollout.answer_key": "reward_model.ground_truth"},
            "saved": lambda: {"rollout.prompts": saved_to_disk(tmp_path / "d"), "rollout.prompt_key": "question",
                              "rollout.answer_key": "label"}}[kind]()
    proc = _run(tmp_path, server_url, **sets)
    assert proc.returncode == 0, proc.stderr[-5000:]
    recs = _records(tmp_path)
    assert len(recs) == 8
    from prompt_rewards import REWARD
    for r in recs:  # the reward came from the row's data_source
        assert r["reward"] == REWARD.get(r["data_source"], 0.25), r["data_source"]


@pytest.mark.slow
def test_resume_mid_epoch_over_parquet_trains_every_prompt_once(tmp_path, server_url):  # noqa: F811
    data = verl_parquet(tmp_path / "d" / "train.parquet", 40)
    args = [CONFIG, *base_overrides(tmp_path, server_url, **{
        "rollout.prompts": data, "rollout.answer_key": "reward_model.ground_truth", "train.steps": 8,
        "train.warm_start_steps": 0, "checkpoint.interval": 2,
        "checkpoint.keep": 0, "logging.rollout_records": str(tmp_path / "records.jsonl")})]
    proc = subprocess.Popen(train_cmd(1) + args, cwd=ROOT, env=env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    marker = tmp_path / "ckpt" / "step_00000004" / "COMPLETE"
    deadline = time.monotonic() + 600
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert marker.exists()
    resumed = run_train(args)
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stderr[-5000:]
    last: dict[int, list] = {}
    for r in _records(tmp_path):
        if r["row"] == 0:
            last[r["step"]] = []
        if r["index"] == 0:
            last[r["step"]].append(tuple(r["prompt_ids"]))
    trained = [p for s in sorted(last) for p in last[s]]
    assert sorted(last) == list(range(8)) and len(trained) == 16 and len(set(trained)) == 16
