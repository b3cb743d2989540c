"""Routing replay data from the rollout side without a server: SGLang's routed experts as hand-made
/generate replies, parsed by the client with its errors, and kept per Sample (rollout/generation/sample.py
documents the layout; the live server's side: test_routed_experts_replay.py)."""
from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from rollout.servers.client import SGLangError, parse_generate_item, routed_experts_layout_of
from rollout.generation.manager import ManagerConfig, RolloutManager
from rollout.generation.sample import Sample

URL = "http://test"


def _item(prompt_tokens, output_ids, routing=None, finish="length"):
    meta = {"prompt_tokens": prompt_tokens, "finish_reason": {"type": finish},
            "weight_version": "default",
            "output_token_logprobs": [[-1.0, t, None] for t in output_ids]}
    if routing is not None:
        meta["routed_experts"] = base64.b64encode(np.asarray(routing, "<i4").tobytes()).decode()
    return {"text": "", "output_ids": list(output_ids), "meta_info": meta}


def _routing(rows, layers=3, k=2, seed=0):
    return np.random.default_rng(seed).integers(0, 8, (rows, layers, k)).astype(np.int32)


# --- parsing -------------------------------------------------------------------------------------
def test_parse_good_reply():
    r = _routing(5 + 4 - 1)
    out = parse_generate_item(_item(5, [1, 2, 3, 4], r), URL, (3, 2))
    assert out.routed_experts.dtype == np.int16 and out.routed_experts.shape == (8, 3, 2)
    np.testing.assert_array_equal(out.routed_experts, r)
    # not requested: not decoded even when present
    assert parse_generate_item(_item(5, [1, 2, 3, 4], r), URL).routed_experts is None


def test_parse_missing_routing_is_a_clear_error_unless_aborted():
    with pytest.raises(SGLangError, match="no meta_info.routed_experts.*--enable-return-routed-experts"):
        parse_generate_item(_item(5, [1, 2]), URL, (3, 2))
    # a request aborted before it ran comes back without it (the sample is generated again)
    assert parse_generate_item(_item(5, [], finish="abort"), URL, (3, 2)).routed_experts is None


@pytest.mark.parametrize("rows", [5 + 2, 5 + 2 - 2])
def test_parse_wrong_size_names_the_expected_size(rows):
    with pytest.raises(SGLangError, match=r"has \d+ bytes, expected 144 = 6 rows .* 3 layers x top-2"):
        parse_generate_item(_item(5, [1, 2], _routing(rows)), URL, (3, 2))
    with pytest.raises(SGLangError, match="not base64"):
        item = _item(5, [1, 2], _routing(6))
        item["meta_info"]["routed_experts"] = "@@not base64@@"
        parse_generate_item(item, URL, (3, 2))


def test_layout_from_hf_config():
    assert routed_experts_layout_of({"num_hidden_layers": 48, "num_experts_per_tok": 8}) == (48, 8)
    assert routed_experts_layout_of({"text_config": {"num_hidden_layers": 4,
                                                     "num_experts_per_tok": 2}}) == (4, 2)
    with pytest.raises(ValueError, match="MoE"):
        routed_experts_layout_of({"num_hidden_layers": 4})


def test_server_flag_and_start_up_patches():
    """A server that returns routes gets the start-up patches that keep a released request's routes
    (rollout/in_server/startup) first on its PYTHONPATH, on a GPU as on a CPU (there before the
    CPU stand-ins); one that does not, none of them."""
    from rollout.in_server.cpu_stand_ins import STAND_INS_DIR
    from rollout.in_server.startup import STARTUP_DIR
    from rollout.servers.launch import ServerConfig, server_process
    import os
    import pathlib
    proc = server_process(ServerConfig("/m", device="cpu", return_routed_experts=True), pathlib.Path("/tmp"))
    assert proc.cmd.count("--enable-return-routed-experts") == 1
    assert proc.env["PYTHONPATH"].split(os.pathsep)[:2] == [str(STARTUP_DIR), str(STAND_INS_DIR)]
    plain = server_process(ServerConfig("/m", device="cpu"), pathlib.Path("/tmp"))
    assert "--enable-return-routed-experts" not in plain.cmd
    assert str(STARTUP_DIR) not in plain.env["PYTHONPATH"]
    for config in (ServerConfig("/m", device="cuda", return_routed_experts=True),
                   ServerConfig("/m", device="cuda", extra_args=["--enable-return-routed-experts"])):
        path = server_process(config, pathlib.Path("/tmp")).env["PYTHONPATH"].split(os.pathsep)
        assert path[0] == str(STARTUP_DIR) and str(STAND_INS_DIR) not in path
    assert str(STARTUP_DIR) not in server_process(ServerConfig("/m", device="cuda"),
                                                  pathlib.Path("/tmp")).env.get("PYTHONPATH", "")


@pytest.mark.slow
def test_start_up_patches_reach_sglang_in_a_gpu_servers_environment(tmp_path):
    """A dry run on CPU of what a GPU server's processes import (spawned: a fresh interpreter with
    the launch's PYTHONPATH, no CPU stand-ins): SGLang's release_req and the collection of routed
    experts are patched, and a sitecustomize the environment had still runs."""
    import os
    import pathlib
    import subprocess
    import sys
    from rollout.servers.launch import ServerConfig, server_process
    own = tmp_path / "site"
    own.mkdir()
    (own / "sitecustomize.py").write_text("import os\nos.environ['SITE_OWN_RAN'] = '1'\n")
    env = server_process(ServerConfig("/m", device="cuda", return_routed_experts=True,
                                      env={"PYTHONPATH": os.pathsep.join([str(own), os.getcwd()])}),
                         pathlib.Path("/tmp")).env
    code = ("import os\n"
            "from sglang.srt.managers import schedule_batch\n"
            "from sglang.srt.managers.scheduler_components import batch_result_processor as brp\n"
            "print(schedule_batch.release_req.gspo_keeps_routes,\n"
            "      brp.SchedulerBatchResultProcessor._maybe_collect_routed_experts.gspo_keeps_routes,\n"
            "      os.environ.get('SITE_OWN_RAN'))\n")
    out = subprocess.run([sys.executable, "-c", code], env={k: v for k, v in env.items()
                                                             if k != "SGLANG_USE_CPU_ENGINE"},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["True", "True", "1"], out.stdout


# --- the Sample record ---------------------------------------------------------------------------
def test_sample_keeps_routing_aligned_with_tokens():
    s = Sample(0, 0, {}, [7, 8, 9], max_new_tokens=20)
    s.append_model_tokens([1, 2], [-1.0, -1.0], ["v", "v"], _routing(4))
    assert s.routed_experts.shape == (5, 3, 2) and (s.routed_experts[-1] == -1).all()
    s.append_env_tokens([3, 4, 5])  # environment tokens: not routed (yet)
    assert s.routed_experts.shape == (8, 3, 2) and (s.routed_experts[4:] == -1).all()
    s.check_aligned()
    with pytest.raises(ValueError, match=r"expected \[9, layers, top-k\]"):
        s.append_model_tokens([6, 7], [-1.0, -1.0], ["v", "v"], _routing(8))
    # the next call had the whole sequence as input: it fills the rows no earlier call covered
    # (the environment tokens and the last sampled token), the earlier call's rows stay: a route
    # belongs to the call (the weight version) that generated the token it predicts
    before = s.routed_experts.copy()
    new = _routing(9, seed=1)
    s.append_model_tokens([6, 7], [-1.0, -1.0], ["v", "v"], new)
    assert s.routed_experts.shape == (10, 3, 2)
    np.testing.assert_array_equal(s.routed_experts[:4], before[:4])
    np.testing.assert_array_equal(s.routed_experts[4:9], new[4:9])
    # a call that came back without routing (aborted early) pads; the older rows stay
    s.append_model_tokens([], [], [], None)
    s.append_model_tokens([9], [-1.0], ["v"], None)
    assert s.routed_experts.shape == (11, 3, 2) and (s.routed_experts[9:] == -1).all()
    s.check_aligned()
    s.routed_experts = s.routed_experts[:-1]
    with pytest.raises(AssertionError, match="routed-experts rows"):
        s.check_aligned()
    # never requested: stays None
    t = Sample(0, 1, {}, [7], max_new_tokens=4)
    t.append_model_tokens([1], [-1.0], ["v"])
    t.append_env_tokens([2])
    assert t.routed_experts is None


def test_sample_and_buffer_json_round_trip():
    s = Sample(3, 1, {"prompt": "p"}, [7, 8, 9], max_new_tokens=20)
    s.append_model_tokens([1, 2], [-0.5, -0.25], ["v", "v"], _routing(4))
    back = Sample.from_dict(json.loads(json.dumps(s.to_dict())))
    assert back == s and back.routed_experts.dtype == np.int16
    np.testing.assert_array_equal(back.routed_experts, s.routed_experts)
    other = Sample.from_dict(json.loads(json.dumps(s.to_dict())))
    other.routed_experts[0, 0, 0] += 1
    assert other != s
    # checkpoints written before routing replay have no such key
    old = s.to_dict()
    del old["routed_experts"]
    assert Sample.from_dict(old).routed_experts is None
    # the manager's rollout buffer (driver.json) keeps it
    mgr = RolloutManager(None, ManagerConfig(), encode_prompt=lambda r: [1], decode=str,
                         reward_fn=lambda r, t: 0.0)
    mgr.groups.buffer.append([s, Sample(3, 0, {"prompt": "p"}, [7, 8, 9], 20)])
    mgr2 = RolloutManager(None, ManagerConfig(), encode_prompt=lambda r: [1], decode=str,
                          reward_fn=lambda r, t: 0.0)
    mgr2.load_state(json.loads(json.dumps(mgr.to_state())))
    assert list(mgr2.groups.buffer) == list(mgr.groups.buffer)
    for m in (mgr, mgr2):
        m.close()


def test_manager_requests_routing_only_when_configured():
    assert ManagerConfig().generate_kwargs() == {}
    assert ManagerConfig(return_routed_experts=True).generate_kwargs() == {"return_routed_experts": True}
