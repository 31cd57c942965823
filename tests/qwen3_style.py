"""A Qwen3-style tokenizer without Loom's markers, and a tiny Qwen3 fitted to given traces.

The tokenizer is a byte-level BPE (Qwen's pre-tokenizer shape) trained with ``tokenizers`` on a few
sentences, with ChatML's ``<|im_start|>`` / ``<|im_end|>`` as special tokens and ``<think>`` /
``</think>`` as added tokens (Qwen3 marks them so: not special, kept when decoding). Loom's trace
markers (``<EOT>``, ``<EOR>``, APR's spawn syntax) are not tokens of it: each encodes to several ids.

The model is a random-weight ``Qwen3ForCausalLM`` (hidden 64, 2 layers) trained for a few hundred
steps on the exact id sequences a mode will build, so that greedy decoding writes the markers the
trace holds and a test sees the modes match them. Nothing here is a stand-in: the engine, the
tokenizer and the model are the real classes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"

CORPUS = [
    "we have 3 and 4. add them. 3+4=7 so the answer is \\boxed{7}.",
    "Now reason step by step, then answer. Wait, check: 4+3=7. Alternatively add again.",
    "<EOT> <EOR> <EOA> <EOS> <ignore> the thought ends; the reasoning ends; the answer ends.",
    "<Calling Sub Searches> <Start Sub Search 0 at level 1> Moving to Node #0 3+4",
    "<End Calling Sub Searches> <Sub Searches Returned> <Result of Sub Search 1> 7",
    "<End Sub Searches Returned> No solution. [child] [spawn] [stream] **Final Answer:**",
]


def qwen3_style_tokenizer(vocab_size: int = 400) -> Any:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in (THINK_OPEN, THINK_CLOSE)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=IM_END,
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )


def encode(tok: Any, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def tiny_qwen3_config(tok: Any, **over: Any) -> Any:
    """A 2-layer, 64-wide Qwen3 config over ``tok``'s vocabulary (``over``: fields to change)."""
    from transformers import Qwen3Config

    fields: dict[str, Any] = {
        "vocab_size": len(tok),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
    }
    return Qwen3Config(**(fields | over))


def fitted_qwen3(tok: Any, sequences: list[list[int]], path: Path, steps: int = 300) -> Any:
    """A tiny Qwen3 trained on ``sequences`` until greedy decoding reproduces them, saved at ``path``
    with ``tok``; returns the float32 eager model (the teacher-forced reference)."""
    import torch
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(tiny_qwen3_config(tok, max_position_embeddings=512, tie_word_embeddings=False))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    batch = [torch.tensor([s]) for s in sequences]
    for _ in range(steps):
        opt.zero_grad()
        loss = sum(model(ids, labels=ids).loss for ids in batch)
        loss.backward()  # type: ignore[union-attr]
        opt.step()
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return Qwen3ForCausalLM.from_pretrained(str(path), attn_implementation="eager").eval()


def teacher_forced(model: Any, ids: list[int], start: int) -> list[float]:
    """log p(ids[i] | ids[:i]) for i >= start, one float32 eager pass."""
    import torch

    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return [logp[i - 1, ids[i]].item() for i in range(start, len(ids))]


def qwen3_chat_template() -> str:
    """Qwen3's own chat template (tools, system turn, thinking), as TRL ships it
    (``trl/chat_templates/qwen3.jinja``): a template that renders ``tools=``."""
    import trl

    return (Path(trl.__file__).parent / "chat_templates" / "qwen3.jinja").read_text()
