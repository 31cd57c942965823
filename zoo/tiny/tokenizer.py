"""The tiny model's tokenizer: a byte-level BPE trained deterministically on the synthetic corpus.

Digits are pre-split one by one (column arithmetic stays digit-aligned), every marker of
loom.formats is one added token, and the special tokens are ``<|bos|>`` ``<|eos|>`` ``<|pad|>``
(``<EOS>`` is the streaming sentence-end marker, not the end of sequence). Nothing is added
automatically when encoding: ``tokenizer(text)`` gives exactly the tokens of ``text``.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from loom.formats import DEFAULT_MARKERS, DEFAULT_SPAWN, Markers, SpawnSyntax

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
VOCAB_SIZE = 512
# The chat template (saved as chat_template.jinja): a message is a prompt line ("[plain] Compute
# 47+85." gets its newline), an assistant turn a completion ended by eos, and nothing is added for
# the generation prompt, so a chat request renders exactly the prompts of zoo/tiny/traces.py.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}\n"
    "{%- if message['role'] == 'assistant' -%}\n"
    "{{ message['content'] }}{{ eos_token }}\n"
    "{%- else -%}\n"
    "{{ message['content'] }}{{ '' if message['content'].endswith('\\n') else '\\n' }}\n"
    "{%- endif -%}\n"
    "{%- endfor -%}\n"
)


def marker_tokens(markers: Markers = DEFAULT_MARKERS, syntax: SpawnSyntax = DEFAULT_SPAWN) -> list[str]:
    return [*markers.special_tokens(), *syntax.tokens]


def train_tokenizer(corpus: Iterable[str], vocab_size: int = VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """Train on ``corpus`` (a fixed, ordered list gives the same vocabulary every time)."""
    markers = marker_tokens()
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # markers become added tokens afterwards: keep them out of the learned merges
    tok.train_from_iterator((_strip(text, markers) for text in corpus), trainer=trainer)
    tok.add_tokens([AddedToken(m, special=False, normalized=False) for m in markers])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=1024,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _strip(text: str, markers: list[str]) -> str:
    for m in markers:
        text = text.replace(m, " ")
    return text
