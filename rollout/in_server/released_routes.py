"""The routes of a request whose KV cache SGLang releases, kept until the request returns: inside
the SGLang server process, installed at start-up by startup/sitecustomize.py (GPU and CPU alike)
when the server returns routed experts.

Why. SGLang 0.5.23 records each token's routed experts per KV slot: a forward writes its top-k
ids at the slots it wrote KV to (state_capturer/base.py BaseTopkCapturer.on_forward_end), and a
finished request reads them back through its slots (SchedulerBatchResultProcessor.
_maybe_collect_routed_experts -> BaseTopkCapturer.get_topk). When SGLang releases a running
request's KV instead (schedule_batch.py release_req: a pause in "retract" mode through
retract_all, a decode batch out of KV cache through ScheduleBatch.retract_decode, a priority
preemption through SchedulePolicy.preempt_to_schedule), the request goes back to the queue with
its tokens and log-probs, and is prefilled again later, by then perhaps under other weights; that
prefill writes new routes at new slots for every position. The response then pairs tokens and
log-probs sampled under the old weights with routes computed under the new ones (measured with
stock 0.5.23: every row sampled under v1 came back with v2's routes).

What. Just before release_req frees the slots, the routes of the positions whose next token was
already sampled (input positions 0 .. prompt + output - 2) are copied off the host buffer onto
the request (`Req.gspo_released_routes`, int16 [rows, layers, k]); a second release adds only
the rows sampled since the first, so every row keeps the routes of the forward that sampled the
token after it. When the request finishes, _maybe_collect_routed_experts reads the slots as
usual (the re-prefilled rows and what was generated after it) and the kept rows replace their
positions. So in every pause mode a token's route is the one of the pass that sampled it: abort
(nothing released), in_place (nothing released), retract (kept here).

A request aborted while it waits in the queue after a release comes back without any routes
(Scheduler.abort_request answers it with an AbortReq, which carries none): the rollout side drops
those tokens and generates them again (rollout/generation/requests.py). Not covered: the retract
of prefill-decode disaggregation (disaggregation/prefill.py calls Req.reset_for_retract itself),
which the project does not run.

Cost: the kept rows live on the server's host until the request returns; at most one more copy
of the host routes buffer (`num_tokens x layers x k`, int16 against its int32), reached when a
pause releases every running request.
Device: nothing here assumes a CPU; the slots are read as get_topk reads them (a device
`req_to_token` row moved to the host, the host buffer indexed there).
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch

ATTR = "gspo_released_routes"
"""The Req attribute that holds the kept rows: int16 [input positions 0 .. n - 1, layers, k]."""

# The SGLang functions wrapped here, by module (the patched versions' names say what they add).
TARGETS = {
    "sglang.srt.managers.schedule_batch": "release_req",
    "sglang.srt.managers.scheduler_components.batch_result_processor":
        "SchedulerBatchResultProcessor._maybe_collect_routed_experts",
}


def keep_routes(req: Any, req_to_token_pool: Any, capturer: Any) -> None:
    """Copy the routes of the positions whose next token `req` has sampled off the capturer's host
    buffer onto req (ATTR), before its KV is released: only rows past those kept at an earlier
    release, and only rows of computed KV."""
    if capturer is None or not getattr(req, "return_routed_experts", False) or not req.output_ids:
        return  # no token sampled yet: its whole prefill runs again, under whatever weights
    if not req.kv.holds_kv or req.kv.req_pool_idx is None:
        return
    kept = getattr(req, ATTR, None)
    start = 0 if kept is None else len(kept)
    # rows 0 .. seqlen - 2: the last output token was not fed yet (or is being fed by a forward
    # whose result is discarded with the release: SchedulerBatchResultProcessor skips retracted
    # requests); never past the KV the request has computed
    seqlen = min(len(req.origin_input_ids) + len(req.output_ids), int(req.kv.kv_committed_len) + 1)
    if seqlen - 1 <= start:
        return
    new = capturer.get_topk(req_pool_idx=req.kv.req_pool_idx, seqlen=seqlen,
                            req_to_token_pool=req_to_token_pool, start_len=start)
    new = new.to(device="cpu", dtype=torch.int16)  # [seqlen - 1 - start, layers, k]
    setattr(req, ATTR, new if kept is None else torch.cat([kept, new]))


def overlay_kept_routes(req: Any) -> None:
    """After _maybe_collect_routed_experts: the kept rows replace the re-prefilled ones of the same
    positions in req.routed_experts (rows from routed_experts_start_len on), and are dropped."""
    kept = getattr(req, ATTR, None)
    if kept is None:
        return
    setattr(req, ATTR, None)
    routes = req.routed_experts
    if routes is None:
        return
    start = int(getattr(req, "routed_experts_start_len", 0) or 0)
    end = min(len(kept), start + len(routes))
    if end > start:
        routes[:end - start] = kept[start:end].to(device=routes.device, dtype=routes.dtype)


def _release_req(original: Callable, capturer_of: Callable) -> Callable:
    @functools.wraps(original)
    def release_req(*args: Any, **kwargs: Any) -> Any:
        keep_routes(kwargs["req"], kwargs["req_to_token_pool"], capturer_of())
        return original(*args, **kwargs)
    setattr(release_req, "gspo_keeps_routes", True)  # installed once, however often imported
    return release_req


def _collect(original: Callable) -> Callable:
    @functools.wraps(original)
    def _maybe_collect_routed_experts(self: Any, req: Any) -> None:
        original(self, req)
        overlay_kept_routes(req)
    setattr(_maybe_collect_routed_experts, "gspo_keeps_routes", True)
    return _maybe_collect_routed_experts


def patch_schedule_batch(module: Any) -> None:
    """schedule_batch.release_req (keyword-only in 0.5.23; retract_all, ScheduleBatch.release_req
    and preemption all call it through the module) keeps the routes first."""
    from sglang.srt.state_capturer.routed_experts import get_global_experts_capturer
    original = module.release_req
    if getattr(original, "gspo_keeps_routes", False):
        return
    module.release_req = _release_req(original, get_global_experts_capturer)


def patch_result_processor(module: Any) -> None:
    cls = module.SchedulerBatchResultProcessor
    original = cls._maybe_collect_routed_experts
    if getattr(original, "gspo_keeps_routes", False):
        return
    cls._maybe_collect_routed_experts = _collect(original)


PATCHES = {"sglang.srt.managers.schedule_batch": patch_schedule_batch,
           "sglang.srt.managers.scheduler_components.batch_result_processor": patch_result_processor}
