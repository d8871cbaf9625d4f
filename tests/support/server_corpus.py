"""Malformed requests for the live ``llamaref serve`` test, with the status each must get.

The server under test runs with ``-c 256``, 4 slots (``-np 4``), a ``--slot-save-path``
and the default ``--body-limit`` of 1 MiB. The statuses follow llamaref/server/schema.py:
400 for an invalid request (the message names the field), 404 for an unknown path or
slot, 405 for a wrong method, 413 for a body over the limit.
"""

from __future__ import annotations

import json

N_SLOTS = 4
BODY_LIMIT = 1 << 20

COMPLETION_PATHS = ("/completion", "/v1/completions")
CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "Hi"}]

# field -> wrong values (each a 400 on every completion endpoint)
WRONG_TYPES = {
    "n_predict": ["5", True, 1.5, [1]], "max_tokens": ["5", {}], "n_keep": ["x"],
    "n_discard": [False], "n": ["2", 1.5], "n_cache_reuse": ["1"], "t_max_predict_ms": [[]],
    "top_k": ["40", True, 0.5], "top_p": ["0.9", [0.9]], "min_p": [True],
    "top_n_sigma": ["1"], "xtc_probability": [{}], "xtc_threshold": ["x"],
    "typical_p": ["1"], "temperature": ["hot", False, [1]], "dynatemp_range": ["x"],
    "dynatemp_exponent": [True], "repeat_last_n": ["64", 1.5], "repeat_penalty": ["1.1"],
    "frequency_penalty": [[0]], "presence_penalty": [{}], "dry_multiplier": ["x"],
    "dry_base": [True], "dry_allowed_length": ["2"], "dry_penalty_last_n": [0.5],
    "mirostat": ["1"], "mirostat_tau": ["5"], "mirostat_eta": [[]], "seed": ["42", 1.5],
    "min_keep": ["1"], "n_probs": ["2"], "id_slot": ["0", 0.5], "stream": [1, "true"],
    "cache_prompt": ["yes"], "return_tokens": [1], "timings_per_token": ["1"],
    "post_sampling_probs": [0], "ignore_eos": ["true"], "stop": [5, [1], {"a": 1}],
    "samplers": [5, [1], ["infill"]], "logit_bias": [5, "x"],
    "dry_sequence_breakers": [[], "x", [1]], "stream_options": [True],
}

OUT_OF_RANGE = [
    {"n_predict": -2}, {"max_tokens": 2**31}, {"n_keep": -2}, {"n_discard": -1},
    {"n": 0}, {"n": N_SLOTS + 1}, {"n_cmpl": 100}, {"n_cache_reuse": -1},
    {"t_max_predict_ms": -2}, {"repeat_last_n": -1}, {"dry_allowed_length": -1},
    {"dry_penalty_last_n": -5}, {"min_keep": -1}, {"id_slot": -2}, {"repeat_penalty": 0},
    {"repeat_penalty": -1},
]

UNSUPPORTED = [
    {"grammar": "root ::= [a-z]+"}, {"json_schema": {"type": "object"}},
    {"response_format": {"type": "json_object"}},
    {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
    {"tool_choice": "required"}, {"suffix": "end"}, {"echo": True}, {"best_of": 3},
]

BAD_PROMPTS = [
    [], 5, True, [1.5], [None], [{"x": 1}], [[0, 1.5]], [-1], [49152], [[1, 2], [10**9]],
    {"prompt_string": "x", "multimodal_data": ["AAAA"]},
]

BAD_MESSAGES = [
    None, [], "Hi", {"role": "user", "content": "Hi"}, [5], [{"content": "Hi"}],
    [{"role": "bot", "content": "Hi"}], [{"role": "USER", "content": "Hi"}],
    [{"role": 1, "content": "Hi"}], [{"role": "user"}], [{"role": "user", "content": None}],
    [{"role": "user", "content": 5}], [{"role": "user", "content": ["Hi"]}],
    [{"role": "user", "content": [{"type": "text"}]}],
    [{"role": "user", "content": [{"type": "image_url",
                                   "image_url": {"url": "data:image/png;base64,AAAA"}}]}],
    [{"role": "user", "content": [{"type": "input_audio",
                                   "input_audio": {"data": "AAAA", "format": "wav"}}]}],
]

BAD_JSON = [b"", b"{", b"not json", b'{"prompt": "x",}', b"[1, 2]", b'"prompt"', b"null",
            b"\xff\xfe{}", b'{"prompt": NaN}', b'{"prompt": "x", "top_k": Infinity}']

BAD_FILENAMES = ["../x", "../../etc/passwd", "a/b", "a\\b", "", ".", "..", "x.", " x",
                 "a\u0000b", "a:b", "a*b", "a?b", "x" * 256,
                 "x" * 243, "é" * 122]  # over 242 bytes: no room for the temporary file


def _completion_cases() -> list[tuple[str, str, bytes | dict, int]]:
    cases: list[tuple[str, str, bytes | dict, int]] = []
    for path in (*COMPLETION_PATHS, CHAT):
        base = {"messages": USER} if path == CHAT else {"prompt": "Hi"}
        for name, values in WRONG_TYPES.items():
            cases += [("POST", path, {**base, name: v, "n_predict": 1}
                       if name not in ("n_predict", "max_tokens") else {**base, name: v}, 400)
                      for v in values]
        cases += [("POST", path, {**base, **body}, 400) for body in OUT_OF_RANGE]
        cases += [("POST", path, {**base, **body}, 400) for body in UNSUPPORTED]
        cases += [("POST", path, raw, 400) for raw in BAD_JSON]
    for path in COMPLETION_PATHS:
        cases += [("POST", path, {"prompt": p}, 400) for p in BAD_PROMPTS]
        cases.append(("POST", path, {"n_predict": 1}, 400))  # no prompt
        cases.append(("POST", path, {"prompt": "hello " * 5000, "n_predict": 1}, 400))
        cases.append(("POST", path, {"prompt": [1] * 5000, "n_predict": 1}, 400))
    cases += [("POST", CHAT, {"messages": m, "n_predict": 1}, 400) for m in BAD_MESSAGES]
    cases.append(("POST", CHAT, {"messages": [{"role": "user", "content": "hello " * 5000}],
                                 "n_predict": 1}, 400))
    cases += [("POST", CHAT, {"messages": USER, "logprobs": 5}, 400),
              ("POST", CHAT, {"messages": USER, "top_logprobs": 3}, 400),
              ("POST", CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 21}, 400),
              ("POST", CHAT, {"messages": USER, "n": N_SLOTS + 1}, 400)]
    return cases


def _oversized() -> list[tuple[str, str, bytes | dict, int]]:
    big = json.dumps({"prompt": "x" * (BODY_LIMIT + 10)}).encode()
    big_chat = json.dumps({"messages": [{"role": "user", "content": "x" * (BODY_LIMIT + 1)}]})
    return [("POST", "/completion", big, 413), ("POST", "/v1/completions", big, 413),
            ("POST", CHAT, big_chat.encode(), 413), ("POST", "/tokenize", big, 413)]


def _slot_cases() -> list[tuple[str, str, bytes | dict, int]]:
    cases: list[tuple[str, str, bytes | dict, int]] = []
    for action in ("save", "restore"):
        cases += [("POST", f"/slots/0?action={action}", {"filename": name}, 400)
                  for name in BAD_FILENAMES]
        cases += [("POST", f"/slots/0?action={action}", body, 400)
                  for body in ({}, {"filename": 5}, {"filename": None}, {"filename": ["a"]})]
        cases += [("POST", f"/slots/{i}?action={action}", {"filename": "ok.bin"}, 404)
                  for i in (N_SLOTS, 99, -1)]
    cases += [("POST", f"/slots/{i}?action=erase", {}, 404) for i in (N_SLOTS, 1000, -1)]
    cases += [("POST", "/slots/0?action=restore", {"filename": "never-saved.bin"}, 404)]
    cases += [("POST", f"/slots/{i}?action=save", {"filename": "ok.bin"}, 400)
              for i in ("abc", "1.5", "0x1")]
    cases += [("POST", f"/slots/0?action={a}", {"filename": "ok.bin"}, 400)
              for a in ("delete", "SAVE", "", "load")]
    cases.append(("POST", "/slots/0", {"filename": "ok.bin"}, 400))  # no action
    cases.append(("POST", "/slots/0?action=save", b"{bad", 400))
    return cases


def _tokenize_cases() -> list[tuple[str, str, bytes | dict, int]]:
    cases: list[tuple[str, str, bytes | dict, int]] = [
        ("POST", "/tokenize", body, 400) for body in (
            {"content": 5}, {"content": {"a": 1}}, {"content": [None]},
            {"content": "x", "add_special": "yes"}, {"content": "x", "parse_special": 1},
            {"content": "x", "with_pieces": "true"})]
    cases += [("POST", "/detokenize", body, 400) for body in (
        {"tokens": "x"}, {"tokens": [1.5]}, {"tokens": [True]}, {"tokens": [-1]},
        {"tokens": [49152]}, {"tokens": {"a": 1}})]
    cases += [("POST", p, raw, 400) for p in ("/tokenize", "/detokenize")
              for raw in (b"{", b"[]")]
    return cases


def _routing_cases() -> list[tuple[str, str, bytes | dict, int]]:
    unknown = ["/nope", "/v1/nope", "/v2/chat/completions", "/completion/extra", "/slots/0/x",
               "/v1/chat", "/admin", "/.env", "/../etc/passwd", "/v1/models/extra"]
    cases: list[tuple[str, str, bytes | dict, int]] = [("GET", p, b"", 404) for p in unknown]
    cases += [("POST", p, {}, 404) for p in unknown[:5]]
    wrong = [("GET", "/completion"), ("GET", "/v1/completions"), ("GET", CHAT),
             ("GET", "/tokenize"), ("GET", "/detokenize"), ("PUT", "/completion"),
             ("DELETE", CHAT), ("PATCH", "/v1/completions"), ("POST", "/health"),
             ("POST", "/v1/models"), ("DELETE", "/slots"), ("PUT", "/slots/0"),
             ("POST", "/metrics"), ("DELETE", "/health")]
    cases += [(m, p, b"", 405) for m, p in wrong]
    return cases


def malformed_requests() -> list[tuple[str, str, bytes | dict, int]]:
    """Bad requests and their expected statuses: ``(method, path, body, status)``.

    A ``dict`` body is sent as JSON, ``bytes`` as they are.

    Examples:
        >>> cases = malformed_requests()
        >>> len(cases) >= 200, sorted({status for *_, status in cases})
        (True, [400, 404, 405, 413])
    """
    return (_completion_cases() + _oversized() + _slot_cases() + _tokenize_cases()
            + _routing_cases())
