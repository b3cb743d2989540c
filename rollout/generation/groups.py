"""The groups a rollout step hands on to the next, owned by the RolloutManager and checkpointed
with it; a step (step.py) takes from and gives back to it, and never sees the manager.

    groups = GroupBuffer()
    groups.buffer     # unfinished groups (partial responses, or waiting for their scores)
    groups.ready      # complete, scored groups a stopped step kept
    gid = groups.next_id()

At the paper's batch (512 prompts x 16 responses a step) the buffer holds at most the step's
open groups (num_groups + oversample_groups) and the ready groups at most one step's: references
to Samples, whose tokens are not copied.
"""
from __future__ import annotations

import collections
from typing import Any

from rollout.generation.sample import Sample


class GroupBuffer:
    def __init__(self) -> None:
        self.buffer: collections.deque[list[Sample]] = collections.deque()
        """Unfinished groups (partial responses, or waiting for their scores) a step left: the
        next step starts them first."""
        self.ready: collections.deque[list[Sample]] = collections.deque()
        """Complete, scored groups a stopped step kept (generate_step(keep_on_stop=True)): the
        next step takes them first, as they are."""
        self.next_group_id = 0

    def next_id(self) -> int:
        """The id of a new group: ids count up over the run (resumes included)."""
        gid = self.next_group_id
        self.next_group_id += 1
        return gid

    def to_state(self) -> dict[str, Any]:
        """As plain data (JSON-serialisable when prompt records are)."""
        return {"next_group_id": self.next_group_id,
                "buffer": [[s.to_dict() for s in g] for g in self.buffer],
                "ready": [[s.to_dict() for s in g] for g in self.ready]}

    def load_state(self, state: dict[str, Any]) -> None:
        self.next_group_id = int(state["next_group_id"])
        self.buffer = collections.deque([Sample.from_dict(d) for d in g] for g in state["buffer"])
        self.ready = collections.deque([Sample.from_dict(d) for d in g] for g in state.get("ready", []))
