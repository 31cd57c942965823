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


# TinyConfig's fields -> LlamaConfig's names for them
LLAMA_NAMES = {
    "hidden": "hidden_size",
    "layers": "num_hidden_layers",
    "heads": "num_attention_heads",
    "intermediate": "intermediate_size",
    "max_positions": "max_position_embeddings",
}


def build_model(tokenizer: PreTrainedTokenizerFast, cfg: TinyConfig = TinyConfig()) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        **{llama: getattr(cfg, name) for name, llama in LLAMA_NAMES.items()},
        num_key_value_heads=cfg.heads,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        attn_implementation="eager",  # type: ignore[call-arg]  # works everywhere; gives attention weights
    )
    return LlamaForCausalLM(config)


def n_params(model: LlamaForCausalLM) -> int:
    return sum(p.numel() for p in model.parameters())


def model_shape(model: LlamaForCausalLM) -> TinyConfig:
    """The architecture a card records, read from the model itself (a fine-tune's is its base's, with
    the positions it was widened to)."""
    return TinyConfig(**{name: getattr(model.config, llama) for name, llama in LLAMA_NAMES.items()})
