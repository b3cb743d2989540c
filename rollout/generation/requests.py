"""The rollout's request threads: one unit of work per sample, run on a pool of threads.

    requests = SampleRequests(pool, config, decode=tok.decode)
    future = requests.submit(sample)   # -> Future[Sample]: the sample, generated (its status says how far)
    requests.abandon                   # set by the drain: calls stop waiting for a stalled server

A unit is one generation request for a single-turn sample (prompt + partial response, asking for
the REMAINING budget) or a whole multi-turn episode (rollout.generation.multiturn.run_episode).
Up to `max_in_flight_requests` run at once; SGLang batches them. Every request has an id of its
own: run tag, group id, sample index and a counter (`request_id`).
"""
from __future__ import annotations

import dataclasses
import itertools
import threading
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from rollout.generation.multiturn.chat import ChatTemplate
from rollout.generation.manager_config import ManagerConfig
from rollout.generation.multiturn import Environment, run_episode
from rollout.generation.sample import DONE, PENDING, Sample
from rollout.servers.pool import ServerPool


class SampleRequests:
    def __init__(self, pool: ServerPool, config: ManagerConfig, decode: Callable[[list[int]], str], *,
                 env_factory: Callable[[dict], Environment] | None = None,
                 encode_text: Callable[[str], list[int]] | None = None, chat: ChatTemplate | None = None,
                 max_turns: int | None = None):
        """RolloutManager's arguments of the same names say what they are."""
        self.pool, self.config, self.decode = pool, config, decode
        self.env_factory, self.encode_text, self.chat, self.max_turns = env_factory, encode_text, chat, max_turns
        self.run_tag = uuid.uuid4().hex[:8]
        self._counter = itertools.count()
        self.abandon = threading.Event()
        """Set: the calls in flight stop waiting for their server (rollout/generation/drain.py)."""
        self._executor = ThreadPoolExecutor(max_workers=config.max_in_flight_requests,
                                            thread_name_prefix="rollout")

    def submit(self, sample: Sample) -> Future[Sample]:
        """Generate (the rest of) `sample` on a thread: DONE, PENDING (aborted: resumable) or, for
        an episode, ABORTED (restarts from its prompt). A server failure is the future's exception."""
        return self._executor.submit(self._run, sample)

    def request_id(self, sample: Sample) -> str:
        return f"{self.run_tag}-{sample.group_id}-{sample.index}-{next(self._counter)}"

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _run(self, sample: Sample) -> Sample:
        if self.env_factory is not None:
            try:
                env = self.env_factory(sample.prompt)
            except Exception as e:  # noqa: BLE001 - a broken environment is recorded and counted
                sample.prompt_ids, sample.reward, sample.status = sample.prompt_ids or [0], 0.0, DONE
                sample.finish_reason, sample.metadata["env_error"] = "env_error", f"{type(e).__name__}: {e}"
                return sample
            return run_episode(sample, env, self.pool, self.config, self.decode, self.encode_text,
                               self.request_id, chat=self.chat, max_turns=self.max_turns,
                               abandon=self.abandon)
        return self._generate_segment(sample)

    def _generate_segment(self, sample: Sample) -> Sample:
        """Generate (the rest of) one single-turn response: prompt + partial -> remaining budget."""
        if sample.remaining_tokens > 0:
            out = self.pool.generate(sample.tokens, self.config.sampling_params(sample.remaining_tokens, sample),
                                     rid=self.request_id(sample), timeout_s=self.config.request_timeout_s,
                                     abandon=self.abandon, **self.config.generate_kwargs())
            if self.config.return_routed_experts and out.routed_experts is None and out.output_ids:
                # SGLang answers an abort of a request it had released and queued again (a
                # retract) without routes (rollout/in_server/released_routes.py): its tokens are
                # generated again rather than kept without the routes they were sampled with
                sample.metadata["unrouted_dropped"] = (sample.metadata.get("unrouted_dropped", 0)
                                                       + len(out.output_ids))
                out = dataclasses.replace(out, output_ids=[], logprobs=[], weight_versions=[])
            sample.append_model_tokens(out.output_ids, out.logprobs, out.weight_versions,
                                       out.routed_experts)
            sample.num_segments += 1 if out.output_ids else 0
            sample.finish_reason = out.finish_reason
        if sample.remaining_tokens <= 0 and sample.finish_reason != "stop":
            sample.finish_reason = "length"
        sample.status = PENDING if sample.finish_reason == "abort" else DONE
        return sample
