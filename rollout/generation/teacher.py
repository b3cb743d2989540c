"""On-policy distillation's teacher: per-token log-probs of the student's own samples from SGLang
servers of a fixed teacher model (prefill only: one request per sample, nothing generated).

    teacher = TeacherScorer(ServerPool(teacher_urls, role=TEACHER), max_in_flight=64)
    future = teacher.submit(group)          # as a group finishes, beside its rewards
    per_sample = future.result()            # [log pi_teacher(y_t) for each response token]

The requests run on threads of their own, concurrently with generation, in the synchronous and
the asynchronous loop; the rollout manager closes a group once its rewards and its teacher
log-probs are in. A multi-turn episode is sent whole (prompt, model turns, environment turns: the
teacher conditions on what the student saw); the trainer uses the log-probs of model tokens only
(loss_mask). The teacher's servers never receive the student's weights: they are another pool,
outside the weight sync. docs/algorithm.md, "On-policy distillation", has the estimator.

The teacher's servers fail like the policy's (rollout/servers/health.py watches their pool too): a request
on a server taken out moves to another teacher server; with none left the call raises
NoTeacherLeft, the step stops as when the policy's servers are lost, and the run waits for a
teacher server to come back (restarted when the run launched it), then runs the step again.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from rollout.servers.pool import ServerPool
from rollout.generation.sample import Sample


class TeacherScorer:
    def __init__(self, pool: ServerPool, *, max_in_flight: int = 64, timeout_s: float = 600.0) -> None:
        self.pool, self.timeout_s = pool, timeout_s
        self._executor = ThreadPoolExecutor(max_workers=max_in_flight, thread_name_prefix="teacher")

    def _one(self, sample: Sample) -> tuple[list[float], float]:
        t0 = time.perf_counter()
        lps = self.pool.input_log_probs(sample.tokens, len(sample.prompt_ids), timeout_s=self.timeout_s)
        return lps, time.perf_counter() - t0

    def submit(self, samples: list[Sample]) -> "Future[list[tuple[list[float], float]]]":
        """(teacher log-probs aligned with response_ids, seconds) per sample, in order; the
        future fails with the first request's error (NoTeacherLeft: no teacher server in service)."""
        out: Future = Future()
        parts = [self._executor.submit(self._one, s) for s in samples]
        left, lock = [len(parts)], threading.Lock()

        def done(_: Any) -> None:
            with lock:
                left[0] -= 1
                if left[0] or out.done():
                    return
            errors = [p.exception() for p in parts if p.exception() is not None]
            if errors:
                out.set_exception(errors[0])
            else:
                out.set_result([p.result() for p in parts])
        for p in parts:
            p.add_done_callback(done)
        return out

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def vocabulary_mismatch(student_dir: str, teacher_dir: str) -> str | None:
    """Why the teacher cannot score the student's tokens, or None: the two tokenizers must map every
    token to the same id (a teacher's embedding padded to more rows, e.g. 151,936 vs 152,064, is
    fine when the ids agree; its log-probs are read for the student's ids only)."""
    from transformers import AutoTokenizer
    student, teacher = (AutoTokenizer.from_pretrained(d).get_vocab() for d in (student_dir, teacher_dir))
    if student == teacher:
        return None
    only_s, only_t = sorted(set(student) - set(teacher)), sorted(set(teacher) - set(student))
    moved = sorted(t for t in set(student) & set(teacher) if student[t] != teacher[t])
    parts = [f"{len(student)} tokens against the teacher's {len(teacher)}"]
    if only_s:
        parts.append(f"{len(only_s)} of the student's are not the teacher's (e.g. {only_s[0]!r})")
    if only_t:
        parts.append(f"{len(only_t)} of the teacher's are not the student's (e.g. {only_t[0]!r})")
    if moved:
        parts.append(f"{len(moved)} have other ids (e.g. {moved[0]!r}: {student[moved[0]]} vs {teacher[moved[0]]})")
    return "another vocabulary: " + "; ".join(parts)
