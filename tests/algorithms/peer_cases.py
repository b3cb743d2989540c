"""Random batches in the peers' layout and in ours, for the transcription tests (test_peer_*.py).

The peers (verl, ROLL, slime) hold a batch as response-only `[b, R]` tensors with a response mask;
the pipeline here holds packed rows of prompt + response (algorithms/advantage/pipeline.py). A case
is both: ragged response lengths, some rows without a trained token, groups of G with some groups
all equal (rewards that are exact in binary, so that the peers' `r - mean` is exactly 0 there too),
log-probs of the policy, pi_old and the reference. fp64 throughout.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

F64 = torch.float64


@dataclass
class Case:
    rewards: torch.Tensor       # [b] outcome rewards
    mask: torch.Tensor          # [b, R] float 0/1 response mask (a prefix of each row)
    lengths: torch.Tensor       # [b] trained tokens per row
    index: list[int]            # [b] the row's group (verl's uid)
    group_size: int
    log_probs: torch.Tensor     # [b, R] the policy's
    old_log_probs: torch.Tensor
    ref_log_probs: torch.Tensor

    @property
    def packed(self):
        """Ours: rows of 1 prompt token + the real response tokens, (lengths, loss_mask [T])."""
        rows = [torch.cat([torch.zeros(1, dtype=torch.bool), torch.ones(int(n), dtype=torch.bool)])
                for n in self.lengths]
        return self.lengths + 1, torch.cat(rows)

    def to_peer(self, packed_values: torch.Tensor) -> torch.Tensor:
        """Our packed per-token values back to the peers' [b, R] (0 at padding)."""
        out = torch.zeros_like(self.mask)
        start = 0
        for i, n in enumerate(self.lengths.tolist()):
            out[i, :n] = packed_values[start + 1:start + 1 + n]
            start += n + 1
        return out

    def from_peer(self, values: torch.Tensor) -> torch.Tensor:
        """The peers' [b, R] per-token values as our packed [T] (0 on the prompt token)."""
        return torch.cat([torch.cat([values.new_zeros(1), values[i, :n]])
                          for i, n in enumerate(self.lengths.tolist())])


def make_case(seed: int, groups: int = 4, group_size: int = 4, width: int = 9, ratio_scale: float = 0.2) -> Case:
    g = torch.Generator().manual_seed(seed)
    b = groups * group_size
    rewards = torch.randn(b, generator=g, dtype=F64)
    rewards[:group_size] = 1.0                          # a group of equal rewards
    rewards[group_size:2 * group_size] = torch.tensor([0.0, 1.0] * (group_size // 2), dtype=F64)  # binary
    lengths = torch.randint(1, width + 1, (b,), generator=g)
    lengths[[1, 2 * group_size + 1]] = 0                # rows without a trained token
    mask = (torch.arange(width)[None, :] < lengths[:, None]).to(F64)
    old = -2 * torch.rand(b, width, generator=g, dtype=F64)
    lp = old + ratio_scale * torch.randn(b, width, generator=g, dtype=F64)
    ref = old + 0.3 * torch.randn(b, width, generator=g, dtype=F64)
    return Case(rewards, mask, lengths, [i // group_size for i in range(b)], group_size, lp, old, ref)


def outcome_rewards(case: Case) -> torch.Tensor:
    """verl's token_level_scores: each reward on the row's last valid response token (an empty row's
    at index -1, as verl's `valid_response_length - 1` puts it)."""
    out = torch.zeros_like(case.mask)
    for i, n in enumerate(case.lengths.tolist()):
        out[i, n - 1] = case.rewards[i]
    return out
