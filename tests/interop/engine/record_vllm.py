"""Record what a real vLLM 0.32 answers on Loom's tiny model: the answers loom engine must give.

Run against a vLLM server on zoo/tiny/checkpoint (docs/interop-engine.md has the command):

    cd tests/interop/engine && python record_vllm.py http://127.0.0.1:PORT > vllm_0.32_tiny.json

Every case is deterministic (greedy, or an error): test_vllm_answers.py replays each request against
``loom engine --model tiny`` and compares. Streams are recorded chunk by chunk.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import httpx

A = "[plain] Compute 47+85.\n"
X = "x"
CHAT = [{"role": "user", "content": "[plain] Compute 47+85."}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
G = {"model": "tiny", "max_tokens": 24, "temperature": 0, "return_token_ids": True}


def completions() -> dict[str, dict[str, Any]]:
    cases: dict[str, dict[str, Any]] = {}
    for name, p in (("arith", A), ("x", X)):
        cases[f"{name}/greedy"] = {"prompt": p}
        for rp in (0.7, 1.5, 3.0):
            cases[f"{name}/repetition_penalty={rp}"] = {"prompt": p, "repetition_penalty": rp}
        for pp in (-2.0, 2.0):
            cases[f"{name}/presence_penalty={pp}"] = {"prompt": p, "presence_penalty": pp}
        for fp in (-1.0, 1.0, 2.0):
            cases[f"{name}/frequency_penalty={fp}"] = {"prompt": p, "frequency_penalty": fp}
        cases[f"{name}/penalties"] = {
            "prompt": p,
            "frequency_penalty": 0.5,
            "presence_penalty": 0.5,
            "repetition_penalty": 1.3,
        }
        cases[f"{name}/min_tokens"] = {"prompt": p, "min_tokens": 20}
        cases[f"{name}/ignore_eos"] = {"prompt": p, "ignore_eos": True, "max_tokens": 40}
        cases[f"{name}/logit_bias"] = {"prompt": p, "logit_bias": {"517": -100, "223": 5, "264": -3}}
        cases[f"{name}/logit_bias clamped"] = {"prompt": p, "logit_bias": {"300": 1000}, "max_tokens": 3}
        cases[f"{name}/allowed_token_ids"] = {"prompt": p, "allowed_token_ids": [13, 22, 23, 24, 25, 1]}
        cases[f"{name}/stop strings after min_tokens"] = {"prompt": p, "stop": ["r", "a"], "min_tokens": 12}
        cases[f"{name}/stop ids after min_tokens"] = {
            "prompt": p,
            "stop_token_ids": [201, 31],
            "min_tokens": 6,
        }
        cases[f"{name}/include_stop_str_in_output"] = {
            "prompt": p,
            "stop": ["r1", "a="],
            "include_stop_str_in_output": True,
        }
        cases[f"{name}/truncate_prompt_tokens"] = {"prompt": p, "truncate_prompt_tokens": 3}
        cases[f"{name}/logprobs=3"] = {"prompt": p, "logprobs": 3, "max_tokens": 6}
        cases[f"{name}/logprobs=0 as ids"] = {
            "prompt": p,
            "logprobs": 0,
            "max_tokens": 6,
            "return_tokens_as_token_ids": True,
        }
        cases[f"{name}/prompt_logprobs=2"] = {"prompt": p, "prompt_logprobs": 2, "max_tokens": 1}
        cases[f"{name}/echo logprobs=1"] = {"prompt": p, "echo": True, "logprobs": 1, "max_tokens": 4}
        cases[f"{name}/skip_special_tokens=false"] = {
            "prompt": p,
            "skip_special_tokens": False,
            "max_tokens": 40,
        }
    cases["echo max_tokens=0"] = {"prompt": A, "echo": True, "logprobs": 1, "max_tokens": 0}
    cases["echo token ids"] = {"prompt": [61, 383, 63], "echo": True, "max_tokens": 2}
    cases["batch of strings"] = {"prompt": [A, X], "logprobs": 0, "return_tokens_as_token_ids": True}
    cases["batch of token ids"] = {"prompt": [[61, 383, 63], [90]], "max_tokens": 4}
    cases["one token-id prompt"] = {"prompt": [61, 383, 63], "max_tokens": 4}
    cases["add_special_tokens=false"] = {"prompt": A, "add_special_tokens": False, "max_tokens": 2}
    cases["seed=-1 greedy"] = {"prompt": A, "seed": -1, "max_tokens": 2}
    cases["top_k=-1 greedy"] = {"prompt": A, "top_k": -1, "max_tokens": 2}
    cases["max_tokens over the room left"] = {"prompt": [90] * 500, "max_tokens": 400}
    errors = {
        "temperature=3": {"temperature": 3},
        "logprobs=21": {"logprobs": 21},
        "logprobs=-1": {"logprobs": -1},
        "prompt_logprobs=21": {"prompt_logprobs": 21},
        "n=2 greedy": {"n": 2},
        "n=0": {"n": 0},
        "top_k=-2": {"top_k": -2},
        "top_p=0": {"top_p": 0},
        "min_p=2": {"min_p": 2},
        "repetition_penalty=0": {"repetition_penalty": 0},
        "presence_penalty=3": {"presence_penalty": 3},
        "frequency_penalty=-3": {"frequency_penalty": -3},
        "min_tokens over max_tokens": {"min_tokens": 30},
        "max_tokens=0": {"max_tokens": 0},
        "max_tokens over the context": {"max_tokens": 600},
        "prompt over the context": {"prompt": [90] * 513},
        "prompt filling the context": {"prompt": [90] * 512},
        "token outside the vocabulary": {"prompt": [600]},
        "empty prompt": {"prompt": ""},
        "no prompts": {"prompt": []},
        "an empty token prompt": {"prompt": [[]]},
        "stream_options without stream": {"stream_options": {"include_usage": True}},
        "unknown model": {"model": "nope"},
        "logit_bias outside the vocabulary": {"logit_bias": {"9999": 1}},
        "allowed_token_ids empty": {"allowed_token_ids": []},
        "allowed_token_ids outside the vocabulary": {"allowed_token_ids": [9999]},
        "five stop strings": {"stop": ["a", "b", "c", "d", "e"]},
        "empty stop string": {"stop": [""]},
        "stream with prompt_logprobs": {"stream": True, "prompt_logprobs": 1},
    }
    for name, fields in errors.items():
        cases[f"error/{name}"] = {"prompt": A, **fields}
    return {name: {**G, **body} for name, body in cases.items()}


def chats() -> dict[str, dict[str, Any]]:
    cases: dict[str, dict[str, Any]] = {
        "greedy": {"messages": CHAT},
        "system and assistant turns": {
            "messages": [
                {"role": "system", "content": "[plain] Compute 1+1."},
                {"role": "assistant", "content": "2"},
                *CHAT,
            ]
        },
        "text parts": {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "[plain] Compute"},
                        {"type": "text", "text": "47+85."},
                    ],
                }
            ]
        },
        "logprobs top_logprobs=2": {"messages": CHAT, "logprobs": True, "top_logprobs": 2, "max_tokens": 4},
        "logprobs as ids": {
            "messages": CHAT,
            "logprobs": True,
            "top_logprobs": 0,
            "return_tokens_as_token_ids": True,
            "max_tokens": 4,
        },
        "echo": {"messages": CHAT, "echo": True, "max_tokens": 4},
        "echo of an assistant turn": {
            "messages": [*CHAT, {"role": "assistant", "content": "<think>"}],
            "echo": True,
            "max_tokens": 4,
            "add_generation_prompt": False,
        },
        "continue_final_message": {
            "messages": [*CHAT, {"role": "assistant", "content": "<think> 7"}],
            "continue_final_message": True,
            "add_generation_prompt": False,
            "max_tokens": 4,
        },
        "max_completion_tokens": {"messages": CHAT, "max_completion_tokens": 3, "max_tokens": None},
        "no max_tokens": {"messages": CHAT, "max_tokens": None},
        "tools with tool_choice none": {
            "messages": CHAT,
            "tools": [TOOL],
            "tool_choice": "none",
            "max_tokens": 2,
        },
        "return_prompt_text": {"messages": CHAT, "return_prompt_text": True, "max_tokens": 2},
        "a role the template renders": {"messages": [{"role": "wizard", "content": "x"}], "max_tokens": 2},
        "no content": {"messages": [{"role": "user"}], "max_tokens": 2},
        "error/request chat_template": {"messages": CHAT, "chat_template": "{{ messages[0]['content'] }}"},
        "error/tools without tool_choice": {"messages": CHAT, "tools": [TOOL]},
        "error/image": {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}],
                }
            ]
        },
        "error/top_logprobs=21": {"messages": CHAT, "logprobs": True, "top_logprobs": 21},
        "error/top_logprobs without logprobs": {"messages": CHAT, "top_logprobs": 2},
        "error/no messages": {"messages": []},
        "error/add_generation_prompt and continue_final_message": {
            "messages": CHAT,
            "continue_final_message": True,
        },
        "error/temperature=3": {"messages": CHAT, "temperature": 3},
    }
    out = {}
    for name, body in cases.items():
        req = {**G, **body}
        out[name] = {k: v for k, v in req.items() if v is not None}
    return out


BATCH = {
    "two conversations": {
        **G,
        "messages": [CHAT, [{"role": "user", "content": "[plain] Compute 1+1."}]],
        "logprobs": True,
        "max_tokens": 30,
    },
    "error/n=2": {**G, "messages": [CHAT], "n": 2, "temperature": 1},
}

STREAMS = {
    "completions/two prompts with usage": (
        "/v1/completions",
        {
            **G,
            "prompt": [A, X],
            "max_tokens": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
            "logprobs": 0,
        },
    ),
    "completions/echo with a stop string": (
        "/v1/completions",
        {**G, "prompt": A, "max_tokens": 40, "stream": True, "stop": ["r9", "+1"], "echo": True},
    ),
    "completions/echo with log-probs and usage per chunk": (
        "/v1/completions",
        {
            **G,
            "prompt": A,
            "max_tokens": 2,
            "stream": True,
            "echo": True,
            "logprobs": 1,
            "return_token_ids": False,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
    ),
    "chat/with usage and log-probs": (
        "/v1/chat/completions",
        {
            **G,
            "messages": CHAT,
            "max_tokens": 5,
            "stream": True,
            "logprobs": True,
            "stream_options": {"include_usage": True},
        },
    ),
}


def main(base: str) -> None:
    http = httpx.Client(base_url=base, timeout=300)
    out: dict[str, Any] = {"vllm": http.get("/version").json(), "completions": {}, "chat": {}, "batch": {}}
    for section, route, cases in (
        ("completions", "/v1/completions", completions()),
        ("chat", "/v1/chat/completions", chats()),
        ("batch", "/v1/chat/completions/batch", BATCH),
    ):
        for name, req in cases.items():
            r = http.post(route, json=req)
            out[section][name] = {"request": req, "status": r.status_code, "response": r.json()}
    out["streams"] = {}
    for name, (route, req) in STREAMS.items():
        with http.stream("POST", route, json=req) as r:
            lines = [ln[len("data: ") :] for ln in r.iter_lines() if ln.startswith("data: ")]
        chunks = [json.loads(ln) for ln in lines if ln != "[DONE]"]
        out["streams"][name] = {
            "route": route,
            "request": req,
            "chunks": chunks,
            "done": lines[-1] == "[DONE]",
        }
    json.dump(out, sys.stdout, indent=1)  # key order kept: vLLM orders top_logprobs (sampled first)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main(sys.argv[1])
