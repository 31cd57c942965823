"""The torch engine's parts on their own (rollout_svc/engines/torch/): the prefix cache's LRU and
longest-prefix take, the batch KV surgery, and the sampling helpers' truncation and stop rules."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from loom.contracts.wire import SamplingParams
from rollout_svc.engines.base import Completion
from rollout_svc.engines.torch import prefix_cache
from rollout_svc.engines.torch.prefix_cache import PrefixCache
from rollout_svc.engines.torch.sampling import accept, new_outputs, truncate


def kv_cache(rows: int, length: int, fill: float = 1.0) -> Any:
    """A one-layer DynamicCache (rows, 2 heads, length, 3 dims) whose values count the columns."""
    cols = torch.arange(length, dtype=torch.float32)[None, None, :, None] * fill
    keys = cols.expand(rows, 2, length, 3).clone()
    return prefix_cache.dynamic_cache([(keys, keys + 100)])


def key(ids: list[int]) -> prefix_cache.Key:
    return [(t, 0) for t in ids]


def test_take_reuses_the_longest_prefix_and_never_the_whole_key() -> None:
    cache = PrefixCache(4)
    cache.store(key([1, 2, 3]), kv_cache(1, 3))
    cache.store(key([1, 2, 3, 4, 5]), kv_cache(1, 5))
    got, reuse = cache.take(key([1, 2, 3, 4, 5]))
    assert reuse == 4  # the last token is always computed: its logits are the next token's
    assert prefix_cache.layers(got)[0][0].shape[2] == 4
    assert len(cache) == 2  # a cropped copy: the entry stays


def test_an_entry_that_is_a_whole_prefix_is_taken_over() -> None:
    cache = PrefixCache(4)
    cache.store(key([1, 2]), kv_cache(1, 2))
    _, reuse = cache.take(key([1, 2, 3]))
    assert reuse == 2 and len(cache) == 0


def test_the_least_recently_used_entry_goes_first() -> None:
    cache = PrefixCache(2)
    cache.store(key([1, 2, 3]), kv_cache(1, 3))
    cache.store(key([4, 5, 6]), kv_cache(1, 3))
    cache.take(key([1, 2, 9]))  # uses (and keeps) the first entry
    cache.store(key([7, 8, 9]), kv_cache(1, 3))
    assert cache.take(key([4, 5, 6, 0]))[1] == 0
    assert cache.take(key([1, 2, 3, 0]))[1] == 3


def test_a_group_key_never_matches_a_plain_one() -> None:
    cache = PrefixCache(2)
    cache.store([(1, 0), (2, 1), (3, 1)], kv_cache(1, 3))
    assert cache.take(key([1, 2, 3, 4]))[1] == 1


def test_retire_keeps_a_rows_real_columns_and_not_its_last_token() -> None:
    cache = PrefixCache(2)
    batch = kv_cache(3, 5)
    cache.retire(key([7, 8]), [10, 11, 12], 0, batch, row=1, start=1)
    (entry,) = cache._entries.values()
    assert entry.key == key([7, 8, 10, 11])
    k, _ = prefix_cache.layers(entry.cache)[0]
    assert k.shape == (1, 2, 4, 3) and k[0, 0, :, 0].tolist() == [1.0, 2.0, 3.0, 4.0]
    PrefixCache(0).retire(key([7]), [1], 0, batch, row=0)  # a disabled cache keeps nothing


def test_merge_left_pads_the_shorter_side() -> None:
    merged = prefix_cache.merge(kv_cache(1, 2), 2, kv_cache(2, 4), 4)
    k, _ = prefix_cache.layers(merged)[0]
    assert k.shape == (3, 2, 4, 3)
    assert k[0, 0, :, 0].tolist() == [0.0, 0.0, 0.0, 1.0] and k[1, 0, :, 0].tolist() == [0.0, 1.0, 2.0, 3.0]
    dropped = prefix_cache.layers(prefix_cache.drop_left(merged, 2))[0][0]
    assert dropped.shape[2] == 2


def test_truncate_keeps_top_k_then_the_top_p_set() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = truncate(logits, SamplingParams(top_k=3)).isfinite()[0].tolist()
    assert kept == [True, True, True, False]
    kept = truncate(logits, SamplingParams(top_p=0.7)).isfinite()[0].tolist()
    assert kept == [True, True, False, False]


@pytest.mark.parametrize(
    ("token", "params", "reason", "stop_reason"),
    [
        (5, SamplingParams(max_tokens=9, stop_token_ids=[5]), "stop", 5),
        (2, SamplingParams(max_tokens=9), "stop", None),
        (3, SamplingParams(max_tokens=1), "length", None),
    ],
)
def test_accept_ends_a_sample_for_its_reason(
    token: int, params: SamplingParams, reason: str, stop_reason: Any
) -> None:
    (c,) = new_outputs(params)
    assert accept(c, token, -0.5, None, 0, params, set(params.stop_token_ids), {2}, tokenizer=None)
    assert (c.finish_reason, c.stop_reason) == (reason, stop_reason)
    assert c.token_ids == [token] and c.logprobs == [-0.5]


def test_accept_goes_on_past_eos_with_ignore_eos() -> None:
    params = SamplingParams(max_tokens=9, ignore_eos=True)
    c = Completion(token_ids=[], logprobs=[])
    assert not accept(c, 2, -0.1, None, 0, params, set(), {2}, tokenizer=None)


def test_accept_stops_on_exactly_a_stop_id_sequence_after_min_tokens() -> None:
    """A multi-token marker ends a sample when the generated ids end with exactly its ids (other
    ids, or the ids reaching into the first ``min_tokens``, do not)."""
    from zoo.tiny import load_tokenizer

    tok = load_tokenizer()
    seq = tok.encode("7+8", add_special_tokens=False)
    assert len(seq) == 3
    params = SamplingParams(max_tokens=20, stop_token_sequences=[seq], min_tokens=1)

    def ends_at(ids: list[int]) -> tuple[int | None, Any]:
        """The number of ids accepted when the sample ended (None: it goes on) and its stop reason."""
        (c,) = new_outputs(params)
        for k, t in enumerate(ids):
            if accept(c, t, -0.1, None, 0, params, set(), {2}, tokenizer=tok):
                return k + 1, c.stop_reason
        return None, None

    assert ends_at([seq[0], seq[1], seq[0], *seq, 5]) == (6, "7+8")
    assert ends_at([*seq, 5]) == (None, None)  # its first id is inside min_tokens
    assert ends_at([5, *seq]) == (4, "7+8")
    assert ends_at([5, seq[0], seq[2], seq[1]]) == (None, None)  # the same ids in another order
