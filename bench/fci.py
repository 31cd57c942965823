"""FCI scorer benchmark (issue 6): loom.fci's streaming scorer vs eager attention
(``output_attentions=True``) on the same random-weight Llama and the same 4k-token sequence.

Each method runs in its own fresh subprocess (one torch thread). Memory method: the increase of the
process's peak RSS (``resource.getrusage(...).ru_maxrss``) during the scoring call over the RSS after
the model and inputs exist and a short warm-up call ran (so first-call code pages and
allocator pools are not counted); this counts every allocation the call made (torch's CPU allocator is
malloc), and nothing else runs in that process. With ``--device cuda`` (a GPU host) the memory is the
increase of ``torch.cuda.max_memory_allocated`` during the call over the allocation before it (the
model, the inputs, after the same warm-up), and times are taken after ``torch.cuda.synchronize``.
Scores are compared step by step (max abs difference).

Usage: ``python bench/fci.py [--tokens 4096] [--layers 4] [--heads 4] [--step 32] [--device cpu]``.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _worker(method: str, tokens: int, layers: int, heads: int, step: int, device: str) -> dict:
    from loom.runtime import configure_process

    configure_process()
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from loom.fci import fci_scores, fci_scores_eager

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=16 * heads,
        intermediate_size=32 * heads,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max(4096, tokens),
    )
    model = LlamaForCausalLM(cfg).eval().to(device)
    model.set_attn_implementation("sdpa")
    cuda = device.startswith("cuda")
    ids = torch.randint(0, 256, (tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    steps = [(a, min(tokens, a + step)) for a in range(0, tokens, step)]

    def score(n: int) -> list[float]:
        spans = [(a, b) for a, b in steps if b <= n]
        if method == "streaming":
            return fci_scores(model, ids[:n], spans, delta=4, block=128)
        return fci_scores_eager(model, ids[:n], spans, delta=4)

    score(8 * step)  # warm-up: first-call code pages and allocator pools are not the method's memory
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    scores = score(tokens)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    if cuda:
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    delta_mib = (peak - base) / 2**20
    return {"scores": scores, "peak_delta_mib": delta_mib, "seconds": seconds, "steps": len(steps)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--step", type=int, default=32, help="tokens per step")
    p.add_argument("--device", default="cpu", help="cpu, or cuda on a GPU host")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        print(json.dumps(_worker(a.worker, a.tokens, a.layers, a.heads, a.step, a.device)))
        return
    out = {}
    for method in ("eager", "streaming"):
        cmd = [
            sys.executable,
            __file__,
            "--worker",
            method,
            "--tokens",
            str(a.tokens),
            "--layers",
            str(a.layers),
        ]
        cmd += ["--heads", str(a.heads), "--step", str(a.step), "--device", a.device]
        res = subprocess.run(cmd, capture_output=True, text=True, check=True)
        out[method] = json.loads(res.stdout.strip().splitlines()[-1])
    e, s = out["eager"], out["streaming"]
    diff = max(abs(x - y) for x, y in zip(e["scores"], s["scores"], strict=True))
    what = "peak CUDA allocation" if a.device.startswith("cuda") else "peak RSS"
    print(
        f"model: random Llama, {a.layers} layers x {a.heads} heads, on {a.device}; "
        f"sequence {a.tokens} tokens, {e['steps']} steps"
    )
    print(f"eager (output_attentions=True): {what} +{e['peak_delta_mib']:.1f} MiB, {e['seconds']:.2f} s")
    print(f"streaming loom.fci:             {what} +{s['peak_delta_mib']:.1f} MiB, {s['seconds']:.2f} s")
    print(
        f"memory ratio eager/streaming: {e['peak_delta_mib'] / max(s['peak_delta_mib'], 1e-9):.1f}x "
        "(target >= 10x)"
    )
    print(f"max |score difference|: {diff:.2e} (tolerance 1e-5); max score {max(e['scores']):.4f}")


if __name__ == "__main__":
    main()
