"""FCI attention scores of a response's steps (AttnRL eq. 6-7; docs/algorithms.md §2.3), for engines that
cannot return attention weights (vLLM).

FCI(k) = max over layers l and heads h of sum_{j >= k + delta} alpha^{l,h}_{j,k}, where
alpha_{j,k} is the step-to-step attention: the mean of the token-level attention over the token pairs
(query in step j, key in step k). The prompt step (0), the first response step (1) and every step from
``zero_from`` on (e.g. from ``</think>``) score 0.

The scorer lives in ``loom.fci`` (shared with the torch engine's ``/v1/score/attention``): a streaming
forward pass that never materialises an L x L attention map.
"""

from __future__ import annotations

from loom.fci import fci_from_step_attention, fci_scores, step_matrix

__all__ = ["fci_from_step_attention", "fci_scores", "step_matrix"]
