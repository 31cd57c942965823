"""Greedy held-out evaluation of the tiny model in every format (a minimal reference rollout of each
format with HF ``generate``; the services' engines and modes are the real thing)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from loom.answers import last_boxed
from loom.formats import DEFAULT_MARKERS, DEFAULT_SPAWN
from zoo.tiny import traces
from zoo.tiny.tasks import Problem


@torch.no_grad()
def generate_batch(
    model: PreTrainedModel,
    tok: PreTrainedTokenizerFast,
    texts: list[str],
    stop: list[str],
    max_new_tokens: int,
    batch_size: int = 32,
    temperature: float = 0.0,
) -> list[str]:
    """Continuations of ``texts`` up to and including the first stop token (eos always stops): greedy,
    or with ``temperature`` > 0 sampled at it from the whole distribution (no top-k or top-p)."""
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
    stop_ids = [tok.convert_tokens_to_ids(s) for s in stop] + [tok.eos_token_id]
    out: list[str] = []
    for k in range(0, len(texts), batch_size):
        chunk = texts[k : k + batch_size]
        enc = tok(chunk, return_tensors="pt", padding=True, padding_side="left")
        gen = model.generate(  # type: ignore[operator]
            **enc,
            max_new_tokens=max_new_tokens,
            **(sampling if temperature > 0 else {"do_sample": False}),
            eos_token_id=stop_ids,
            pad_token_id=tok.pad_token_id,
        )
        for row in gen[:, enc["input_ids"].shape[1] :].tolist():
            ids: list[int] = []
            for t in row:
                if t == tok.pad_token_id:
                    break
                if t == tok.eos_token_id:
                    break
                ids.append(t)
                if t in stop_ids:
                    break
            out.append(str(tok.decode(ids)))
    return out


@dataclass(frozen=True)
class Budgets:
    """Greedy token limits per generation call (the search model's traces are longer: zoo/search)."""

    plain: int = 100
    reflect: int = 160
    thought: int = 24
    final: int = 100
    spawn_head: int = 140
    child: int = 80
    join_answer: int = 40


@dataclass
class FormatResult:
    correct: int = 0
    parsed: int = 0
    total: int = 0
    sample: str = ""

    @property
    def accuracy(self) -> float:
        return self.correct / max(1, self.total)


def eval_plain(
    model, tok, problems: list[Problem], reflect: bool = False, b: Budgets = Budgets()
) -> FormatResult:  # type: ignore[no-untyped-def]
    build = traces.reflect_prompt if reflect else traces.plain_prompt
    prompts = [build(p) for p in problems]
    outs = generate_batch(model, tok, prompts, [], b.reflect if reflect else b.plain)
    res = FormatResult(total=len(problems), sample=prompts[0] + outs[0] if outs else "")
    for p, o in zip(problems, outs, strict=True):
        ans = last_boxed(o) if "</think>" in o else None
        res.parsed += ans is not None
        res.correct += p.verify(ans)
    return res


def eval_stream(model, tok, problems: list[Problem], b: Budgets = Budgets()) -> FormatResult:  # type: ignore[no-untyped-def]
    m = DEFAULT_MARKERS
    states, sentences = [], []
    for p in problems:
        header, obs = traces.stream_prompt(p)
        states.append(header)
        sentences.append(obs)
    thoughts: list[list[str]] = [[] for _ in problems]
    for t in range(max(len(s) for s in sentences)):
        active = [i for i, s in enumerate(sentences) if t < len(s)]
        texts = [states[i] + sentences[i][t] for i in active]
        outs = generate_batch(model, tok, texts, [m.thought_end], b.thought)
        for i, text, o in zip(active, texts, outs, strict=True):
            states[i] = text + o
            thoughts[i].append(o)
    texts = [s + traces.stream_connector() for s in states]
    finals = generate_batch(model, tok, texts, [m.answer_end], b.final)
    res = FormatResult(total=len(problems), sample=texts[0] + finals[0] if finals else "")
    for p, th, fin in zip(problems, thoughts, finals, strict=True):
        parsed = traces.parse_stream(th, fin)
        res.parsed += parsed.well_formed
        res.correct += parsed.well_formed and p.verify(parsed.answer)
    return res


def eval_spawn(model, tok, problems: list[Problem], b: Budgets = Budgets()) -> FormatResult:  # type: ignore[no-untyped-def]
    s = DEFAULT_SPAWN
    prompts = [traces.spawn_prompt(p) for p in problems]
    heads = generate_batch(model, tok, prompts, [s.spawn_close], b.spawn_head)
    texts = [pr + h for pr, h in zip(prompts, heads, strict=True)]
    spawns = [traces.parse_spawn(h) if h.endswith(s.spawn_close) else None for h in heads]
    child_texts, owners = [], []
    for i, children in enumerate(spawns):
        for _, _, message in children or []:
            child_texts.append(traces.child_prompt(message))
            owners.append(i)
    child_outs = generate_batch(model, tok, child_texts, [], b.child)
    messages: list[list[str]] = [[] for _ in problems]
    for i, o in zip(owners, child_outs, strict=True):
        messages[i].append(traces.child_message(o))
    resumed = [t + traces.join_block(msgs) for t, msgs in zip(texts, messages, strict=True)]
    finals = generate_batch(model, tok, resumed, [], b.join_answer)
    res = FormatResult(total=len(problems), sample=resumed[0] + finals[0] if finals else "")
    for p, sp, fin in zip(problems, spawns, finals, strict=True):
        ans = last_boxed(fin) if sp else None
        res.parsed += ans is not None
        res.correct += p.verify(ans)
    return res


def evaluate(
    model, tok, problems: dict[str, list[Problem]], b: Budgets = Budgets()
) -> dict[str, FormatResult]:  # type: ignore[no-untyped-def]
    """``problems``: format -> held-out problems. Returns format -> result."""
    model.eval()
    out = {}
    for fmt, ps in problems.items():
        if fmt == "plain":
            out[fmt] = eval_plain(model, tok, ps, b=b)
        elif fmt == "reflect":
            out[fmt] = eval_plain(model, tok, ps, reflect=True, b=b)
        elif fmt == "stream":
            out[fmt] = eval_stream(model, tok, ps, b)
        elif fmt == "spawn":
            out[fmt] = eval_spawn(model, tok, ps, b)
    return out
