"""Sampling one token per row: vLLM's logits processors (``process_logits``), then temperature /
min-p / top-k / top-p with the request's seeded generator (``sample``; one uniform a row,
``draw``), and the bookkeeping of an accepted token: log-probs, top log-probs, stop ids, EOS, stop
strings and ``max_tokens`` (``accept``). Pure functions of tensors and params; the engine supplies
its model's EOS ids and tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from loom.contracts.wire import SamplingParams
from rollout_svc.engines.base import Completion

LogprobsMode = Literal["raw", "processed"]


def has_logits_processors(params: SamplingParams) -> bool:
    return bool(
        params.allowed_token_ids is not None
        or params.min_tokens
        or params.logit_bias
        or params.repetition_penalty != 1.0
        or params.presence_penalty
        or params.frequency_penalty
    )


def process_logits(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt_ids: list[int],
    outputs: list[list[int]],
    stop_ids: set[int],
) -> torch.Tensor:
    """vLLM's logits processors that run before the temperature, in vLLM's order (0.32,
    vllm/v1/sample/sampler.py): the allowed-token whitelist; ``min_tokens`` (a row with fewer than
    ``min_tokens`` outputs cannot sample ``stop_ids``: EOS and the stop token ids); the logit bias;
    then the penalties: repetition (tokens of the prompt or the output: a positive logit divided by
    it, a negative one multiplied), frequency (times the count in the output) and presence (once per
    token seen in the output). Row r of ``logits`` continues ``prompt_ids + outputs[r]``."""
    x = logits.clone()
    device = x.device
    if params.allowed_token_ids is not None:
        keep = torch.zeros(x.shape[-1], dtype=torch.bool, device=device)
        keep[torch.tensor(params.allowed_token_ids, device=device)] = True
        x.masked_fill_(~keep, float("-inf"))
    if params.min_tokens and stop_ids:
        short = [r for r, out in enumerate(outputs) if len(out) < params.min_tokens]
        if short:
            rows = torch.tensor(short, device=device)[:, None]
            x[rows, torch.tensor(sorted(stop_ids), device=device)[None, :]] = float("-inf")
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), device=device)
        x[:, ids] += torch.tensor(list(params.logit_bias.values()), dtype=x.dtype, device=device)
    if params.repetition_penalty != 1.0 or params.presence_penalty or params.frequency_penalty:
        x = _penalties(x, params, prompt_ids, outputs)
    return x


def _penalties(
    x: torch.Tensor, params: SamplingParams, prompt_ids: list[int], outputs: list[list[int]]
) -> torch.Tensor:
    device = x.device
    counts = torch.zeros_like(x)
    for r, out in enumerate(outputs):
        if out:
            counts[r].index_add_(0, torch.tensor(out, device=device), torch.ones(len(out), device=device))
    in_output = counts > 0
    if params.repetition_penalty != 1.0:
        seen = in_output.clone()
        if prompt_ids:
            seen[:, torch.tensor(prompt_ids, device=device)] = True
        p = params.repetition_penalty
        x = torch.where(seen, torch.where(x > 0, x / p, x * p), x)
    x -= params.frequency_penalty * counts + params.presence_penalty * in_output
    return x


def truncate(scaled: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """min-p (after the temperature, as vLLM), then top-k, then top-p: the dropped logits -inf."""
    if params.min_p > 0.0:
        probs = torch.softmax(scaled, dim=-1)
        floor = probs.amax(dim=-1, keepdim=True) * params.min_p
        scaled = scaled.masked_fill(probs < floor, float("-inf"))
    if params.top_k > 0 and params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_l, order = torch.sort(scaled, dim=-1, descending=True)
        probs = torch.softmax(sorted_l, dim=-1)
        drop = probs.cumsum(dim=-1) - probs > params.top_p  # keep the smallest set reaching p
        sorted_l = sorted_l.masked_fill(drop, float("-inf"))
        scaled = torch.full_like(scaled, float("-inf")).scatter(-1, order, sorted_l)
    return scaled


def sample(
    logits: torch.Tensor,
    params: SamplingParams,
    gen: torch.Generator,
    logprobs_mode: LogprobsMode,
    eos_ids: set[int],
    prompt_ids: list[int] | None = None,
    outputs: list[list[int]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, their log-probs, the log-prob table the top-k log-probs are read from).

    ``outputs[r]`` are the tokens row r has generated so far and ``prompt_ids`` its prompt: the
    penalties and ``min_tokens`` read them (``process_logits``). The log-probs are the raw model's
    (``logprobs_mode="raw"``, vLLM's default) or the processed distribution's (``"processed"``)."""
    raw = torch.log_softmax(logits, dim=-1)
    if has_logits_processors(params):
        stop = eos_ids | set(params.stop_token_ids)
        logits = process_logits(logits, params, prompt_ids or [], outputs or [[]] * len(logits), stop)
    if params.temperature == 0.0:
        tokens = logits.argmax(dim=-1)
        # vLLM's processed log-probs of a greedy request: after the processors, no temperature
        table = raw if logprobs_mode == "raw" else torch.log_softmax(logits, dim=-1)
    else:
        processed = torch.log_softmax(truncate(logits / params.temperature, params), dim=-1)
        tokens = draw(processed.exp(), [(gen, 0, len(logits))])
        table = raw if logprobs_mode == "raw" else processed
    return tokens, table.gather(1, tokens[:, None]).squeeze(1), table


@dataclass(frozen=True)
class TopRows:
    """Top log-probs of some rows (what ``accept`` reads of ``torch.topk``'s result)."""

    values: torch.Tensor
    indices: torch.Tensor


def is_plain(params: SamplingParams) -> bool:
    """Sampled by ``sample_rows`` with other requests' rows: temperature only (or greedy), no logits
    processor and no truncation."""
    return (
        not has_logits_processors(params)
        and params.min_p == 0.0
        and params.top_p >= 1.0
        and params.top_k <= 0
    )


def sample_rows(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    draws: list[tuple[torch.Generator, int, int]],
    logprobs_mode: LogprobsMode,
    unit: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``sample`` for the rows of many plain requests at once (``is_plain``): row r at
    ``temperature[r]`` (0: greedy). Every request draws its rows ``draws[i][1]:draws[i][2]`` from its
    own generator (``draw``), as ``sample`` does, so its tokens are the ones it gets alone;
    everything else is one tensor operation over all rows. ``unit``: every temperature is 1 or 0, so
    the tempered distribution is the raw one (dividing by 1 is exact) and its log-softmax is not
    computed twice."""
    raw = torch.log_softmax(logits, dim=-1)
    greedy = temperature == 0.0
    processed = (
        raw if unit else torch.log_softmax(logits / torch.where(greedy, 1.0, temperature)[:, None], dim=-1)
    )
    tokens = draw(processed.exp(), draws)
    if sum(stop - start for _, start, stop in draws) < len(logits):  # greedy rows (no device sync)
        tokens = torch.where(greedy, logits.argmax(dim=-1), tokens)
    table = raw if logprobs_mode == "raw" else processed
    return tokens, table.gather(1, tokens[:, None]).squeeze(1), table


DRAW_BLOCK = 1024  # vocabulary entries a block of ``draw``'s two-level search


def draw(probs: torch.Tensor, draws: list[tuple[torch.Generator, int, int]]) -> torch.Tensor:
    """One token per row of ``probs`` by inverse transform: u ~ U[0, 1) from the generator that owns
    the row (``draws``: (generator, start, stop), rows ``start:stop``, one float64 a row in row
    order), the token where the row's cumulative probability first passes u x its total. A token of
    probability 0 has an empty interval and is never drawn (the target stays below each total it is
    compared with). Two levels past ``DRAW_BLOCK`` entries: the blocks' masses (float32 sums, each
    as exact as the float32 probabilities it adds), the block found, then a float64 cumulative sum
    of that block only; so every token's interval is its probability to float32's relative
    precision, where one float32 cumulative sum over a whole vocabulary would blur a token of
    probability 1e-9 by the 6e-8 rounding of the running total. One uniform a row, where the
    exponential race ``argmax(p / E)`` of ``torch.multinomial`` draws one per entry: 19 ns an entry
    on one core, 23 ms a step for 8 rows of a 152k vocabulary (docs/benchmarks/engine.md). Rows no
    generator owns (greedy) draw u = 0: the caller takes their argmax."""
    rows, vocab = probs.shape
    device = probs.device
    parts, at = [], 0
    for gen, start, stop in sorted(draws, key=lambda d: d[1]):
        if start > at:
            parts.append(torch.zeros(start - at, dtype=torch.float64, device=device))
        parts.append(torch.rand(stop - start, dtype=torch.float64, generator=gen, device=device))
        at = stop
    if at < rows:
        parts.append(torch.zeros(rows - at, dtype=torch.float64, device=device))
    u = torch.cat(parts)[:, None]
    if vocab <= DRAW_BLOCK:
        cdf = probs.double().cumsum(dim=1)
        return _place(cdf, u * cdf[:, -1:]).squeeze(1)
    full = vocab - vocab % DRAW_BLOCK
    sums = [probs[:, :full].view(rows, -1, DRAW_BLOCK).sum(-1)]
    if full < vocab:
        sums.append(probs[:, full:].sum(-1, keepdim=True))
    edges = torch.cat(sums, dim=1).double().cumsum(dim=1)  # (rows, blocks): the mass to each block's end
    target = u * edges[:, -1:]
    block = _place(edges, target)
    below = torch.where(block > 0, edges.gather(1, (block - 1).clamp(min=0)), 0.0)
    first = block * DRAW_BLOCK
    cols = first + torch.arange(DRAW_BLOCK, device=device)
    inside = probs.gather(1, cols.clamp(max=vocab - 1)).double().masked_fill_(cols >= vocab, 0.0)
    return (first + _place(inside.cumsum(dim=1), target - below)).squeeze(1)


def _place(cdf: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per row, the first index whose cumulative ``cdf`` (non-decreasing) is above ``target``, the
    target first held below the row's total; a row of NaNs (a broken model) gets the last index."""
    total = cdf[:, -1:]
    target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[1] - 1)


def generator(params: SamplingParams, device: str) -> torch.Generator:
    """The request's generator: seeded by ``params.seed``, else by a fresh random seed."""
    gen = torch.Generator(device=device)
    gen.manual_seed(params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)).item()))
    return gen


def new_outputs(params: SamplingParams) -> list[Completion]:
    """``params.n`` empty completions (with top log-probs lists when they are asked for)."""
    out = [Completion(token_ids=[], logprobs=[]) for _ in range(params.n)]
    if params.logprobs:
        for c in out:
            c.top_logprobs = []
    return out


def stop_string(tokenizer: Any, gen_ids: list[int], stops: list[str], start: int = 0) -> str | None:
    """The stop string in the text of the last tokens, looking no earlier than token ``start``
    (``min_tokens``: vLLM searches only the text after it)."""
    width = max(len(s) for s in stops) + 2
    tail = tokenizer.decode(gen_ids[max(start, len(gen_ids) - width) :], skip_special_tokens=True)
    for s in stops:
        if s in tail:
            return s
    return None


def stop_sequence(gen_ids: list[int], params: SamplingParams) -> list[int] | None:
    """The stop sequence the generated ids end with, exact on ids (a multi-token marker's canonical
    ids, ``loom.formats.marker_ids``), wholly after the first ``min_tokens`` tokens."""
    for seq in params.stop_token_sequences:
        n = len(seq)
        if len(gen_ids) - n >= params.min_tokens and gen_ids[len(gen_ids) - n :] == seq:
            return seq
    return None


def accept(
    c: Completion,
    t: int,
    lp: float,
    top: Any,
    r: int,
    params: SamplingParams,
    stop_ids: set[int],
    eos_ids: set[int],
    tokenizer: Any,
) -> bool:
    """Append token ``t`` (log-prob ``lp``, top-k row ``r`` of ``top``) to ``c``; True if ``c`` ends."""
    c.token_ids.append(t)
    c.logprobs.append(lp)
    if top is not None and c.top_logprobs is not None:
        d = {int(k): float(v) for k, v in zip(top.indices[r], top.values[r], strict=True)}
        d[t] = lp
        c.top_logprobs.append(d)
    if t in stop_ids:
        c.finish_reason, c.stop_reason = "stop", t
    elif t in eos_ids and not params.ignore_eos:
        c.finish_reason, c.stop_reason = "stop", None
    elif params.stop_token_sequences and (seq := stop_sequence(c.token_ids, params)) is not None:
        c.finish_reason, c.stop_reason = "stop", tokenizer.decode(seq, skip_special_tokens=False)
    elif (
        params.stop
        and len(c.token_ids) > params.min_tokens
        and (s := stop_string(tokenizer, c.token_ids, params.stop, params.min_tokens)) is not None
    ):
        c.finish_reason, c.stop_reason = "stop", s
    elif len(c.token_ids) >= params.max_tokens:
        c.finish_reason = "length"
    else:
        return False
    return True
