"""Detectors: gold (through the reward service's verifier), model (labels, log-probs, strengths,
fallback on malformed output, against ``loom engine`` serving the tiny model), heuristic, fixed."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from reflect_helpers import decoder, trace_group  # noqa: E402

from loom.contracts.wire import Group  # noqa: E402
from reflect_svc.backends import HTTPServices  # noqa: E402
from reflect_svc.chunking import Chunk, Thinking, chunk_thinking  # noqa: E402
from reflect_svc.detectors import (  # noqa: E402
    detect_fixed,
    detect_gold,
    detect_heuristic,
    detect_model,
    model_prompt,
    parse_labels,
    reflection_starts,
    result_probs,
    token_text,
)
from reflect_svc.reflection_model import ReflectionModel, parse_completion  # noqa: E402
from reflect_svc.revise import ServiceError  # noqa: E402

KEYWORDS = ["wait", "alternatively", "check", "but"]


def toy_thinking(texts: list[str], size: int = 10) -> Thinking:
    chunks = [Chunk(i * size, (i + 1) * size, t) for i, t in enumerate(texts)]
    return Thinking(start=0, end=size * len(texts), chunks=chunks, closed=True)


# ----------------------------------------------------------------------------------------- gold


def test_gold_matches_through_the_reward_service_for_exact_and_math_tasks(reward_url):
    services = HTTPServices("http://127.0.0.1:9", reward_url)
    try:
        arith = Group(id="a", label="254", task="arithmetic")
        texts = ["2+5=7 r7\nSo far r57", "So the answer is 254.", "Wait, let me check: 254-47=207. Yes."]
        assert services.match(arith, texts) == [False, True, False]
        cd = Group(id="c", label="", task="countdown", meta={"numbers": [1, 2, 5], "target": 12})
        assert services.match(cd, ["5+1=6", "So the answer is (5+1)*2.", "2*6=12"]) == [False, True, False]
        math_g = Group(id="m", label="\\frac{1}{2}")
        texts = ["We get $x = \\frac{2}{4}$ so far.", "Thus \\boxed{0.5}.", "It is 3."]
        assert services.match(math_g, texts) == [True, True, False]  # math-verify: 2/4 = 1/2
    finally:
        services.close()


def test_gold_detector_picks_the_first_answer_chunk_of_a_trace(tok, reward_url):
    services = HTTPServices("http://127.0.0.1:9", reward_url)
    try:
        g = trace_group(tok, "arith", n=1, seed=3)
        th = chunk_thinking(g.trajectories[0].completion_ids, decoder(tok), min_tokens=8)
        verdicts = services.match(g, [c.text for c in th.chunks])
        det = detect_gold(th, verdicts)
        assert det.chunk == 0 and det.cut == th.chunks[0].end
        assert f"So the answer is {g.label}." in th.chunks[0].text
    finally:
        services.close()


def test_gold_detector_reports_no_detection_and_a_down_verifier():
    th = toy_thinking(["a.", "b."])
    assert detect_gold(th, [False, False]).status == "no_detection"
    services = HTTPServices("http://127.0.0.1:9", "http://127.0.0.1:9")  # nothing listens there
    services.reward.retries = 0
    with pytest.raises(ServiceError) as err:
        services.match(Group(id="x", label="1"), ["1"])
    assert err.value.status == "verifier_error"
    services.close()


# ----------------------------------------------------------------------------------------- heuristic


def test_reflections_in_a_run_count_once():
    text = "So 5. Wait, let me check: yes. " + "x" * 80 + " But is it? Alternatively 5."
    starts = reflection_starts(text, KEYWORDS, 59)
    assert [text[s : s + 4] for s in starts] == ["Wait", "But "]


def test_heuristic_cuts_before_the_chunk_with_the_kth_reflection():
    th = toy_thinking(
        ["Compute 5.", "Wait, it is 5.", "Hmm, " + "fine " * 15 + "indeed.", "Alternatively 5 again."]
    )
    det1 = detect_heuristic(th, 1, KEYWORDS)
    assert det1.cut == 10 and det1.chunk == 0
    det2 = detect_heuristic(th, 2, KEYWORDS)
    assert det2.cut == 30 and det2.chunk == 2
    assert detect_heuristic(th, 5, KEYWORDS).status == "no_detection"


def test_blank_keywords_are_ignored_not_matched_at_every_word():
    text = "So it is 7. Wait, check it. It is 7."
    assert reflection_starts(text, [""]) == [] and reflection_starts(text, [" ", "\t"]) == []
    assert reflection_starts(text, ["", "wait"]) == reflection_starts(text, ["wait"]) == [12]
    th = toy_thinking(["So it is 7.", " It is seven.", " Yes, 7."])
    assert detect_heuristic(th, 1, [""]).status == "no_detection"
    assert detect_heuristic(th, 1, [" "]).cut is None


# ----------------------------------------------------------------------------------------- fixed


def test_fixed_truncation_cuts_at_the_nearest_line_end():
    th = Thinking(start=2, end=102, chunks=[Chunk(2, 102, "x")], line_cuts=[20, 55, 75, 90])
    assert detect_fixed(th, 0.7).cut == 75  # target 72
    assert detect_fixed(th, 0.5).cut == 55  # target 52
    assert detect_fixed(th, 1.0).cut is None


# ----------------------------------------------------------------------------------------- model


def test_labels_parse_only_with_the_exact_count_and_order():
    ok = parse_labels("[1]. Think\n[2]. Result\n[3]. Result", 3)
    assert ok is not None and [lab.result for lab in ok] == [False, True, True]
    assert parse_labels("[1]. Think\n[2]. Result", 3) is None  # too few
    assert parse_labels("[1]. Think\n[2]. Result\n[3]. Think\n[4]. Think", 3) is None  # too many
    assert parse_labels("[1]. Think\n[3]. Result\n[2]. Think", 3) is None  # out of order
    assert parse_labels("as an AI I cannot 1 2 3 Result", 3) is None  # garbage


def test_p_result_from_top_logprobs_and_the_three_strengths():
    # byte-level tokens as `loom engine` returns them; top log-probs at each label token
    tokens = ["[", "1", "].", "ĠThink", "Ċ", "[", "2", "].", "ĠResult", "Ċ", "[", "3", "].", "ĠThink", "Ċ"]
    tokens += ["[", "4", "].", "ĠResult"]
    tops: list[dict[str, float] | None] = [None] * len(tokens)
    tops[3] = {"ĠThink": math.log(0.9), "ĠResult": math.log(0.1)}
    tops[8] = {"ĠResult": math.log(0.6), "ĠThink": math.log(0.4)}
    tops[13] = {"ĠThink": math.log(0.6), "ĠRes": math.log(0.3), "Ġ": math.log(0.1)}  # partial word counts
    tops[18] = {"ĠResult": math.log(0.99)}
    text = "".join(token_text(t) for t in tokens)
    assert text.startswith("[1]. Think\n[2]. Result")
    labels = parse_labels(text, 4)
    assert labels is not None
    probs = result_probs(labels, tokens, tops)
    assert probs == pytest.approx([0.1, 0.6, 1 / 3, 1.0])
    th = toy_thinking(["a.", "b.", "c.", "d."])
    assert detect_model(th, text, "normal", tokens, tops).chunk == 1  # first P >= 0.5
    assert detect_model(th, text, "weak", tokens, tops).chunk == 3  # second Result
    assert detect_model(th, text, "strong", tokens, tops).chunk == 1  # first P >= 0.25
    tops[3] = {"ĠThink": math.log(0.7), "ĠResult": math.log(0.3)}
    assert detect_model(th, text, "strong", tokens, tops).chunk == 0  # P = 0.3 >= 0.25
    assert (
        detect_model(th, "[1]. Think\n[2]. Think\n[3]. Think\n[4]. Think", "normal").status == "no_detection"
    )


def test_malformed_model_output_falls_back_to_no_truncation():
    th = toy_thinking(["a.", "b.", "c."])
    for bad in ["[1]. Result", "lorem ipsum", "", "[1]. Result\n[2]. Think\n[3]. Think\n[4]. Result"]:
        det = detect_model(th, bad, "normal")
        assert det.cut is None and det.status == "malformed_output"


def test_chat_responses_parse_like_completions():
    body = {
        "choices": [
            {
                "message": {"role": "assistant", "content": "[1]. Think\n[2]. Result"},
                "logprobs": {
                    "content": [
                        {"token": t, "logprob": -0.1, "top_logprobs": [{"token": t, "logprob": -0.1}]}
                        for t in ["[", "1", "].", " Think", "\n", "[", "2", "].", " Result"]
                    ]
                },
            }
        ]
    }
    out = parse_completion(body)
    assert out.text == "[1]. Think\n[2]. Result" and out.tokens and len(out.tokens) == 9
    det = detect_model(toy_thinking(["a.", "b."]), out.text, "normal", out.tokens, out.tops)
    assert det.chunk == 1 and det.probs == [0.0, 1.0]


def test_model_detector_against_loom_engine_serving_the_tiny_model(tok, engine_url):
    """One call labels every chunk; the tiny model's labels are poor, so the answer is either a
    well-formed labelling with P(Result) from real top log-probs, or the typed fallback."""
    g = trace_group(tok, "arith", n=1, seed=4)
    th = chunk_thinking(g.trajectories[0].completion_ids, decoder(tok), min_tokens=8)
    model = ReflectionModel(engine_url, model="tiny", top_logprobs=5, tokens_per_chunk=6)
    out = model.label(model_prompt(g.prompt or "", th.chunks), len(th.chunks))
    assert out.tokens is not None and out.tops is not None and len(out.tokens) == len(out.tops)
    assert all(top for top in out.tops)  # top-k log-probs for every output token
    det = detect_model(th, out.text, "normal", out.tokens, out.tops)
    if parse_labels(out.text, len(th.chunks)) is None:
        assert det.status == "malformed_output" and det.cut is None
    else:
        assert det.probs is not None and all(0.0 <= p <= 1.0 for p in det.probs)
    down = ReflectionModel("http://127.0.0.1:9", timeout_s=2)
    services = HTTPServices("http://127.0.0.1:9", "http://127.0.0.1:9", down)
    with pytest.raises(ServiceError) as err:
        services.label("q", 2)
    assert err.value.status == "model_error"
    services.close()
