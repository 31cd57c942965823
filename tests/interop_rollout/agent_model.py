"""A real small Llama checkpoint that calls Loom's calculator, for the agent-seam tests
(tests/interop_rollout/test_agent_seams.py; docs/interop-rollout.md, "Agent mode at each trainer's seam").

The built-in models call no tool on their own, so these weights are set to: the embeddings are
orthonormal rows, and the output head maps each token's row to the token that follows it in
``SCRIPT`` (a successor chain: the prompt's last character ``?`` is followed by
``<call>calculator(2+3)</call>``, the tool response's closing newline by the end of text, any other
token by the end of text). The two decoder layers keep random weights, scaled by ``LAYER_SCALE``:
each log-prob depends on the whole sequence before it (not on the last token alone), so a
teacher-forced pass that misplaced a turn or an observation would not match. It is loaded with
``from_pretrained`` and served by the real torch engine like any checkpoint; the sampled turns are
the engine's, at temperature 1, and follow the whole chain about 4 times in 5
(``MARGIN``)."""

from __future__ import annotations

import string
from pathlib import Path

SPECIALS = ["<pad>", "<unk>", "</s>"]
WORDS = ["<call>", "</call>", "<result>", "</result>", "calculator"]  # one token each
CHARS = list(string.ascii_lowercase + string.digits + " .,?+-*/=()\n<>{}\\:;'_\"!%^")
PROMPT = "what is 2+3?"  # its last token, '?', starts the call
SCRIPT = ["?", "<call>", "calculator", "(", "2", "+", "3", ")", "</call>"]
AFTER_OBSERVATION = ("\n", "</s>")  # the tool response's last token ends the episode
HIDDEN = 80
MARGIN = 10.0  # the chain's logit over the others': about 0.97 per step, 0.8 for the whole call
LAYER_SCALE = 4.0


def build_agent_model(path: Path, seed: int = 5) -> Path:
    import torch
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    tok.add_tokens([AddedToken(w, normalized=False, special=False) for w in WORDS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    path.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(path))
    ids = {t: fast.convert_tokens_to_ids(t) for t in SPECIALS + CHARS + WORDS}
    size = len(fast)
    assert size <= HIDDEN, "orthonormal embedding rows need hidden_size >= vocab"
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=size,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        eos_token_id=ids["</s>"],
        pad_token_id=ids["<pad>"],
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    successor = {t: ids["</s>"] for t in range(size)}
    for a, b in zip(SCRIPT, SCRIPT[1:], strict=False):
        successor[ids[a]] = ids[b]
    successor[ids[AFTER_OBSERVATION[0]]] = ids[AFTER_OBSERVATION[1]]
    with torch.no_grad():
        q, _ = torch.linalg.qr(torch.randn(HIDDEN, HIDDEN))
        rows = q[:size]  # orthonormal: token t's row
        model.model.embed_tokens.weight.copy_(rows)
        head = torch.zeros(size, HIDDEN)
        for t, nxt in successor.items():
            head[nxt] += rows[t]
        # RMSNorm scales a unit row to norm sqrt(HIDDEN): the chain's logit is MARGIN over the rest
        model.lm_head.weight.copy_(head * (MARGIN / HIDDEN**0.5))
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(LAYER_SCALE)
            layer.mlp.down_proj.weight.mul_(LAYER_SCALE)
    model.save_pretrained(str(path))
    return path
