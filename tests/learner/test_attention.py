"""FCI scores (AttnRL) from hooked per-layer reductions equal a brute-force computation."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from learner.attention import fci_scores


def test_fci_matches_brute_force_over_layers_and_heads(model_dir):
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (33,), generator=g).tolist()
    steps = [(0, 5), (5, 9), (9, 15), (15, 18), (18, 24), (24, 28), (28, 33)]
    delta = 2
    got = fci_scores(model, ids, steps, delta=delta, zero_from=6)
    with torch.no_grad():
        att = model(torch.tensor([ids]), output_attentions=True).attentions  # per layer [1, H, L, L]
    want = [0.0] * len(steps)
    for k in range(len(steps)):
        best = 0.0
        for layer in att:
            for h in range(layer.shape[1]):
                total = 0.0
                for j in range(k + delta, len(steps)):
                    (qa, qb), (ka, kb) = steps[j], steps[k]
                    total += float(layer[0, h, qa:qb, ka:kb].mean())
                best = max(best, total)
        want[k] = best
    for k in (0, 1, 6):  # prompt step, first step, steps from zero_from on
        want[k] = 0.0
    assert torch.allclose(torch.tensor(got), torch.tensor(want), atol=1e-5)
    assert max(got) > 0
