"""``llamaref serve`` over HTTP against what one request may ask (issue 31): sampler values
refused when the request is read and never hurting another request, per-request allocations
bounded, every answer valid JSON with finite numbers, and llama-server's own behaviour where
ours differed (``tokens`` only when asked, ``timings`` with the usage chunk, assistant prefill,
``system_fingerprint``)."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from llamaref.server import formats
from tests.support.server_support import LiveServer, alone, make_engine, tokenizer


@pytest.fixture(scope="module")
def server():
    srv = LiveServer(lambda: make_engine("reference", n_slots=3, n_ctx=256, n_batch=64,
                                         n_ubatch=32))
    yield srv
    srv.close()


def strict_json(text: str):
    """JSON as a strict parser reads it: no NaN, no Infinity."""
    def refuse(name):
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


def post(srv, path: str, body: dict, **kw) -> requests.Response:
    return requests.post(srv.url + path, json=body, timeout=120, **kw)


def events(r: requests.Response) -> list:
    """The data of a server-sent event stream, ``[DONE]`` left out."""
    out = []
    for line in r.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(strict_json(line[6:]))
    return out


# ---- item 1: a sampler value is a 400 naming the field, and never fails another request ---------

def test_a_sampler_value_the_chain_cannot_use_is_a_400_and_the_others_are_served(server):
    prompt = tokenizer().tokenize("Hello there friend", add_special=True, parse_special=True)
    greedy = {"prompt": prompt, "n_predict": 6, "temperature": 0}
    with ThreadPoolExecutor(3) as pool:
        witnesses = [pool.submit(post, server, "/completion", greedy) for _ in range(2)]
        bad = post(server, "/completion", {"prompt": "Hi", "repeat_penalty": 1e-310})
        answers = [w.result() for w in witnesses]
    assert bad.status_code == 400
    assert bad.json()["error"]["message"].startswith("Field 'repeat_penalty': value must be "
                                                     "between 1.1754944e-38")
    for a in answers:
        assert a.status_code == 200
        assert a.json()["content"] == tokenizer().detokenize(alone("reference", prompt, 6))


@pytest.mark.parametrize("extra", [
    {"mirostat": 1, "mirostat_tau": 600}, {"mirostat": 1, "mirostat_eta": 1e30},
    {"mirostat": 2, "mirostat_eta": 1e30},
    {"temperature": 1, "dynatemp_range": 0.5, "dynatemp_exponent": -1, "top_k": 0, "top_p": 1,
     "min_p": 0, "logit_bias": [[7042, 100000]]},
])
def test_extreme_finite_sampler_values_are_served(server, extra):
    r = post(server, "/completion", {"prompt": "Hi", "n_predict": 4, **extra})
    assert r.status_code == 200 and strict_json(r.text)["tokens_predicted"] == 4


# ---- item 4: bounded requests ------------------------------------------------------------------

@pytest.mark.parametrize("body, field", [
    ({"n_probs": 100000}, "n_probs"), ({"logit_bias": [[1, 1.0]] * 1025}, "logit_bias"),
    ({"stop": ["x"] * 17}, "stop"), ({"n": 4}, "n"),
])
def test_requests_beyond_the_server_limits_are_400s_naming_the_field(server, body, field):
    r = post(server, "/completion", {"prompt": "Hi", "n_predict": 2, **body})
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith(f"Field '{field}'")


# ---- item 5: valid JSON never gets a 500, every answer is finite JSON ---------------------------

@pytest.mark.parametrize("bias", [{"²": 1}, {"--5": 1}, {"": 1}, {" 12": False}])
def test_logit_bias_keys_that_are_not_numbers_are_text(server, bias):
    r = post(server, "/completion", {"prompt": "Hi", "n_predict": 2, "logit_bias": bias})
    assert r.status_code == 200


def test_a_malformed_prompt_string_is_a_400(server):
    r = post(server, "/completion", {"prompt": [[1, 2], "x", {"prompt_string": 5}],
                                     "n_predict": 2})
    assert r.status_code == 400 and "Field 'prompt'" in r.json()["error"]["message"]


@pytest.mark.parametrize("extra", [
    {"temperature": 1e-40, "n_probs": 2, "post_sampling_probs": True},
    {"temperature": 1e-40, "n_probs": 2},
    {"logit_bias": [[7, 1e300], [8, 1e300]], "n_probs": 2, "post_sampling_probs": True},
])
@pytest.mark.parametrize("stream", [False, True])
def test_overflowing_probabilities_are_finite_json(server, extra, stream):
    body = {"prompt": "Hi", "n_predict": 3, "stream": stream, **extra}
    r = post(server, "/completion", body)
    assert r.status_code == 200
    objs = events(r) if stream else [strict_json(r.text)]
    assert objs[-1]["stop"] is True and "error" not in objs[-1]
    probs = [p for o in objs for p in o.get("completion_probabilities", [])]
    assert len(probs) == 3
    key = "prob" if extra.get("post_sampling_probs") else "logprob"
    assert all(isinstance(p[key], float) for p in probs)
    r = post(server, "/v1/completions", {**body, "logprobs": 2})
    assert r.status_code == 200
    for obj in (events(r) if stream else [strict_json(r.text)]):
        assert "error" not in obj


# ---- items 14, 15, 19: llama-server's fields ---------------------------------------------------

def test_completion_tokens_only_when_asked(server):
    body = {"prompt": "Hi", "n_predict": 3, "temperature": 0}
    assert post(server, "/completion", body).json()["tokens"] == []
    asked = post(server, "/completion", {**body, "return_tokens": True}).json()["tokens"]
    assert len(asked) == 3
    streamed = events(post(server, "/completion", {**body, "stream": True}))
    assert all(e["tokens"] == [] for e in streamed)
    streamed = events(post(server, "/completion", {**body, "stream": True,
                                                   "return_tokens": True}))
    assert [t for e in streamed for t in e["tokens"]] == asked


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "Hi"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
])
def test_the_usage_chunk_carries_the_timings(server, path, body):
    r = post(server, path, {**body, "max_tokens": 3, "stream": True,
                            "stream_options": {"include_usage": True}})
    last = events(r)[-1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 3
    assert last["timings"]["predicted_n"] == 3


def test_system_fingerprint_is_the_build_info(server):
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                              "max_tokens": 2})
    fp = r.json()["system_fingerprint"]
    assert fp == formats.SYSTEM_FINGERPRINT
    assert re.fullmatch(r"b\d+\.\d+\.\d+-([0-9a-f]{7}|unknown)", fp)


# ---- item 16: assistant prefill ------------------------------------------------------------------

def chat(server, messages, **kw) -> requests.Response:
    return post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 4,
                                                 "temperature": 0, **kw})


def test_a_final_assistant_message_is_continued(server):
    user = {"role": "user", "content": "Write a word"}
    r = chat(server, [user, {"role": "assistant", "content": "The word is"}])
    assert r.status_code == 200
    prompt = tokenizer().apply_chat_template([user], True) + "The word is"
    text = post(server, "/completion", {"prompt": prompt, "n_predict": 4,
                                        "temperature": 0}).json()["content"]
    assert r.json()["choices"][0]["message"]["content"] == text


def test_two_assistant_messages_at_the_end_are_a_400(server):
    r = chat(server, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "A"},
                      {"role": "assistant", "content": "B"}])
    assert r.status_code == 400
    assert r.json()["error"]["message"] == ("Cannot have 2 or more assistant messages at the "
                                            "end of the list.")


def test_generation_prompt_and_continuation_together_are_a_400(server):
    r = chat(server, [{"role": "user", "content": "Hi"}], add_generation_prompt=True,
             continue_final_message=True)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == ("Cannot set both add_generation_prompt and "
                                            "continue_final_message to true.")
