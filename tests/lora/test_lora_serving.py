"""LoRA end to end against a real SGLang server on CPU (the stand-in of
rollout/in_server/cpu_stand_ins/lora_ops.py): trainer ranks under EP2 train adapters with GSPO
and sync them as adapters only; after each sync the server's log-probs of its own generation equal
the trainer's (fp32, 1e-5); the trainer's PEFT export loads in SGLang's own LoRA loader and
serves the same; requests in flight across an adapter update all finish, none waits forever and
none runs without the adapter.

One server (per-expert adapters, rank 4) for the module and one spawn of two trainer ranks.
"""
from __future__ import annotations

import threading

import pytest
import torch

from distributed import run_distributed
from fixtures_models import tiny_model_dir

pytestmark = pytest.mark.slow
PROMPT = [5, 77, 301, 12, 9, 140, 33]
TOL = 1e-5
SETTINGS = dict(rank=4, alpha=8, experts="per_expert")


@pytest.fixture(scope="module")
def lora_server():
    from fixtures_servers import launch_tiny_server
    from gspo_megatron.lora.lora_settings import LoraSettings
    from gspo_megatron.lora.serving import server_args
    with launch_tiny_server("qwen3_moe", extra_args=server_args(LoraSettings(**SETTINGS), cuda=False)) as group:
        yield group


def _trainer_log_probs(actor, tokens: list[int], n_prompt: int) -> torch.Tensor | None:
    from test_weight_sync_sglang import _trainer_log_probs as log_probs
    return log_probs(actor, tokens, n_prompt)


def _step(actor, seed: int) -> None:
    from test_weight_sync_sglang import _gspo_step
    _gspo_step(actor, seed)


def _body(rank, world, ckpt, url, export_dir):
    from gspo_megatron.actor.actor import Actor
    from gspo_megatron.actor.settings import OptimizerSettings
    from gspo_megatron.checkpoint import checkpoint_hf_config
    from gspo_megatron.lora.lora_settings import LoraSettings
    from gspo_megatron.lora.peft import peft_config, save_peft, to_peft
    from gspo_megatron.lora.serving import ADAPTER_NAME
    from gspo_megatron.parallel.layout import ParallelLayout
    from gspo_megatron.sync.adapter_sync import AdapterSync
    from model_specs.weights.maps import weight_map_for
    from rollout.servers.pool import ServerPool

    hf = checkpoint_hf_config(ckpt)
    settings = LoraSettings(**SETTINGS)
    actor = Actor(hf, ParallelLayout(expert=2), micro_batch_size=2, lora=settings,
                  optimizer=OptimizerSettings(lr=2e-2, clip_grad=0.0))
    actor.load_weights(ckpt)
    pool = ServerPool([url]) if rank == 0 else None
    if pool is not None:
        pool.use_adapter(ADAPTER_NAME)
    sync = AdapterSync(actor.chunks, hf, pool, settings)

    def served(name=ADAPTER_NAME):
        out = [None]
        if rank == 0:
            pool.use_adapter(name)
            gen = pool.generate(PROMPT, {"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True})
            pool.use_adapter(ADAPTER_NAME)
            out = [(gen.output_ids, torch.tensor(gen.logprobs), gen.weight_versions)]
        torch.distributed.broadcast_object_list(out, src=0)
        return out[0]

    def compare(got):
        mine = _trainer_log_probs(actor, PROMPT + got[0], len(PROMPT))
        return None if mine is None else float((mine - got[1]).abs().max())

    results = {"reports": []}
    results["reports"].append(sync.sync("v1"))  # creates the adapter: A from the seed, B zero
    first = served()
    results["v1"] = (compare(first), first[2])
    for step in (2, 3):
        _step(actor, seed=step)
        results[f"moved{step}"] = compare(first if step == 2 else results["last"])
        results["reports"].append(sync.sync(f"v{step}"))
        results["last"] = served()
        results[f"v{step}"] = (compare(results["last"]), results["last"][2])
    full = actor.full_adapter_state_dict(to_all_ranks=False)
    if rank == 0:  # the PEFT export, loaded by SGLang's own loader from the folder
        tensors = to_peft(full, weight_map_for(hf))
        save_peft(export_dir, tensors, peft_config(settings, tensors))
        pool.clients[0].load_lora_adapter("exported", export_dir)
    torch.distributed.barrier()
    exported = served("exported")
    results["exported"] = compare(exported)
    if rank == 0:
        pool.clients[0].unload_lora_adapter("exported")
    # requests in flight across an update: rank 0 keeps two long generations running meanwhile
    outcomes, threads = [], []
    if rank == 0:
        def generate():
            try:
                outcomes.append(pool.generate(PROMPT, {"max_new_tokens": 48, "temperature": 1.0,
                                                      "ignore_eos": True}))
            except Exception as e:  # noqa: BLE001 - the test reports it
                outcomes.append(e)
        threads = [threading.Thread(target=generate) for _ in range(2)]
        for t in threads:
            t.start()
    _step(actor, seed=4)
    results["reports"].append(sync.sync("v4"))
    for t in threads:
        t.join(timeout=300)
    if rank == 0:
        results["in_flight"] = [o if isinstance(o, Exception) else (o.finish_reason, sorted(set(o.weight_versions)))
                                for o in outcomes]
        results["adapters"] = pool.clients[0].lora_adapters()
        results["alive"] = [t.is_alive() for t in threads]
    return results


def test_adapters_only_sync_serves_the_trainers_policy(lora_server, tmp_path):
    from gspo_megatron.checkpoint.convert import convert_hf_to_megatron

    ckpt = convert_hf_to_megatron(tiny_model_dir("qwen3_moe", 0), tmp_path / "mcore")
    results = run_distributed(_body, 2, (str(ckpt), lora_server.server_urls[0], str(tmp_path / "peft")),
                              timeout=600)
    r = next(x for x in results if x.get("v1") and x["v1"][0] is not None)
    for version in ("v1", "v2", "v3"):
        worst, versions = r[version]
        assert set(versions) == {version}
        assert worst <= TOL, f"{version}: max |sglang - trainer| {worst:.3g}"
    assert r["moved2"] > 1e-3 and r["moved3"] > 1e-3, "the GSPO steps must move the log-probs"
    assert r["exported"] <= TOL
    print("|sglang - trainer|:", {v: r[v][0] for v in ("v1", "v2", "v3")}, "exported", r["exported"],
          "moved", r["moved2"], r["moved3"], "sync s", [round(rep["seconds"], 2) for rep in results[0]["reports"]])
    created = [rep["full_syncs"] for rep in results[0]["reports"]]
    assert created == [1.0, 0.0, 0.0, 0.0], "created once, then written in place"
    assert all(rep["bytes"] > 0 for rep in results[0]["reports"])
    flight = results[0]["in_flight"]
    assert not any(results[0]["alive"]) and len(flight) == 2
    assert all(not isinstance(o, Exception) and o[0] == "length" and set(o[1]) <= {"v3", "v4"}
               for o in flight), flight
    assert results[0]["adapters"] == ["gspo"]
