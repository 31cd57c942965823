"""The group-position layout (StreamingThinker), shared by the torch engine and the learner so that
generation and log-prob recomputation see exactly the same positions and visibility.

Each token belongs to a group (0 = source/observations, 1.. = targets); positions count from 0 within
each group, and query i sees key j iff j <= i (causal) and groups[j] <= groups[i].
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def group_positions(groups: Sequence[int]) -> list[int]:
    """Position of each token within its own group, counted from 0."""
    seen: dict[int, int] = {}
    out = []
    for g in groups:
        out.append(seen.get(g, 0))
        seen[g] = out[-1] + 1
    return out


def group_visibility(groups: Sequence[int], q_start: int = 0, device: Any = None) -> torch.Tensor:
    """Boolean [q, kv] matrix for queries ``groups[q_start:]`` over keys ``groups``."""
    g = torch.tensor(list(groups), device=device)
    kv = len(groups)
    q_idx = torch.arange(q_start, kv, device=device)
    k_idx = torch.arange(kv, device=device)
    return (k_idx[None, :] <= q_idx[:, None]) & (g[None, :] <= g[q_idx][:, None])
