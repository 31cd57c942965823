"""The tiny causal LM: a small Llama from transformers (nothing custom, so every engine loads it)."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast


@dataclass(frozen=True)
class TinyConfig:
    hidden: int = 128
    layers: int = 4
    heads: int = 4
    intermediate: int = 384
    max_positions: int = 512


def build_model(tokenizer: PreTrainedTokenizerFast, cfg: TinyConfig = TinyConfig()) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden,
        intermediate_size=cfg.intermediate,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.heads,
        max_position_embeddings=cfg.max_positions,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        attn_implementation="eager",  # type: ignore[call-arg]  # works everywhere; gives attention weights
    )
    return LlamaForCausalLM(config)


def n_params(model: LlamaForCausalLM) -> int:
    return sum(p.numel() for p in model.parameters())
