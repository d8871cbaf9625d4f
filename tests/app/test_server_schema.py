"""The server's request parsing (llamaref/server/schema.py) and response formats
(llamaref/server/formats.py), against llama.cpp's rules (tools/server/server-schema.cpp,
server-task.cpp) and OpenAI's shapes."""

from __future__ import annotations

import json
import math

import pytest

from llamaref.server import formats, schema
from llamaref.server.app import NATIVE, OAI_CHAT, Meta
from llamaref.server.errors import error_json, http_status
from reference.common import LLAMA_DEFAULT_SEED
from reference.model_loader import default_model_path
from reference.tokenizer import Tokenizer
from reference.tools.server.errors import InvalidRequest
from reference.tools.server.params import SlotParams
from reference.tools.server.results import (
    FLT_LOWEST,
    Final,
    Partial,
    Timings,
    TokenOutput,
    TokenProb,
)
from tests.support.server_corpus import malformed_requests


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_gguf(default_model_path())


def parse(body, tok, **kw):
    return schema.parse_completion(body, SlotParams(), 4, tok.n_vocab, tok, **kw)


def error_of(body, tok, **kw) -> str:
    with pytest.raises(InvalidRequest) as e:
        parse(body, tok, **kw)
    return str(e.value)


# ---- the body -----------------------------------------------------------------------------------

def test_parse_json():
    assert schema.parse_json(b'{"a": 1}', 100) == {"a": 1}
    for raw in (b"{", b"", b"\xff\xfe", b'{"a": NaN}', b'{"a": Infinity}', b"[]", b'"x"'):
        with pytest.raises(InvalidRequest, match="Invalid JSON"):
            schema.parse_json(raw, 100)
    with pytest.raises(schema.BodyTooLarge) as e:
        schema.parse_json(b"{}" + b" " * 200, 100)
    assert http_status(e.value) == 413 and "100" in str(e.value)
    assert error_json(e.value)["error"]["type"] == "invalid_request_error"


# ---- numeric fields -----------------------------------------------------------------------------

INT_FIELDS = ["n_predict", "max_tokens", "max_completion_tokens", "n_keep", "n_discard", "n",
              "n_cmpl", "n_cache_reuse", "t_max_predict_ms", "top_k", "repeat_last_n",
              "dry_allowed_length", "dry_penalty_last_n", "mirostat", "min_keep", "seed",
              "n_probs", "logprobs", "id_slot"]
FLOAT_FIELDS = ["top_p", "min_p", "top_n_sigma", "xtc_probability", "xtc_threshold",
                "typical_p", "temperature", "dynatemp_range", "dynatemp_exponent",
                "repeat_penalty", "frequency_penalty", "presence_penalty", "dry_multiplier",
                "dry_base", "mirostat_tau", "mirostat_eta"]
BOOL_FIELDS = ["stream", "cache_prompt", "return_tokens", "timings_per_token",
               "post_sampling_probs", "ignore_eos"]


@pytest.mark.parametrize("name", INT_FIELDS)
@pytest.mark.parametrize("bad", ["7", True, [1], {"a": 1}, 2.5])
def test_int_field_type_errors_name_the_field(tok, name, bad):
    assert f"Field '{name}'" in error_of({name: bad}, tok)


@pytest.mark.parametrize("name", FLOAT_FIELDS)
@pytest.mark.parametrize("bad", ["0.5", False, [0.5], {}, math.nan, math.inf])
def test_float_field_type_errors_name_the_field(tok, name, bad):
    assert f"Field '{name}'" in error_of({name: bad}, tok)


@pytest.mark.parametrize("name", BOOL_FIELDS)
@pytest.mark.parametrize("bad", [1, "true", 0.0, []])
def test_bool_field_type_errors_name_the_field(tok, name, bad):
    assert f"Field '{name}'" in error_of({name: bad}, tok)


@pytest.mark.parametrize("body", [
    {"n_predict": -2}, {"max_tokens": 2**31}, {"n_keep": -2}, {"n_discard": -1},
    {"n": 0}, {"n": 5}, {"n_cmpl": 9}, {"n_cache_reuse": -1}, {"t_max_predict_ms": -2},
    {"repeat_last_n": -1}, {"dry_allowed_length": -1}, {"dry_penalty_last_n": -1},
    {"min_keep": -1}, {"id_slot": -2}, {"repeat_penalty": 0}, {"repeat_penalty": -1.0},
])
def test_hard_limits_are_errors(tok, body):
    (name,) = body
    assert f"Field '{name}'" in error_of(body, tok)


def test_soft_limits_clamp(tok):
    p = parse({"top_k": -5, "top_p": 1.5, "min_p": -0.1, "xtc_probability": 2,
               "xtc_threshold": -1, "temperature": -1, "mirostat": 7}, tok)
    s = p.sampling
    assert (s.top_k, s.top_p, s.min_p, s.xtc_probability, s.xtc_threshold, s.temp,
            s.mirostat) == (0, 1.0, 0.0, 1.0, 0.0, 0.0, 2)
    assert parse({"mirostat": -3}, tok).sampling.mirostat == 0
    assert parse({"n_probs": -4}, tok).n_probs == 0


def test_values_and_aliases(tok):
    p = parse({"max_tokens": 5, "n": 3, "top_k": 7.0, "typical_p": 0.5, "repeat_penalty": 1.1,
               "frequency_penalty": 0.2, "presence_penalty": 0.3, "seed": 42,
               "dry_base": 0.5, "t_max_predict_ms": 2**40, "id_slot": 6}, tok)
    assert (p.n_predict, p.n_cmpl, p.sampling.top_k, p.sampling.typ_p) == (5, 3, 7, 0.5)
    assert (p.sampling.penalty_repeat, p.sampling.penalty_freq) == (1.1, 0.2)
    assert p.sampling.penalty_present == 0.3 and p.sampling.seed == 42
    assert p.sampling.dry_base == SlotParams().sampling.dry_base  # < 1: the default
    assert p.t_max_predict_ms == 2**40 and p.id_slot == 2  # ids wrap (get_slot_by_id)
    # the name wins over its aliases; aliases in llama.cpp's order
    assert parse({"n_predict": 1, "max_tokens": 2}, tok).n_predict == 1
    assert parse({"max_completion_tokens": 3, "max_tokens": 2}, tok).n_predict == 3
    assert parse({"n_cmpl": 2, "n": 4}, tok).n_cmpl == 2


def test_null_means_default(tok):
    body = {name: None for name in INT_FIELDS + FLOAT_FIELDS + BOOL_FIELDS}
    body.update(stop=None, logit_bias=None, samplers=None, dry_sequence_breakers=None,
                stream_options=None, response_format=None, grammar=None, tools=None)
    assert parse(body, tok) == SlotParams()
    assert parse({"n_predict": None, "max_tokens": 9}, tok).n_predict == 9


def test_defaults_are_not_modified(tok):
    defaults = SlotParams(n_predict=10, stop=["x"])
    p = schema.parse_completion({"logit_bias": [[5, 1]], "ignore_eos": True}, defaults, 4,
                                tok.n_vocab, tok)
    assert defaults.sampling.logit_bias == {} and p.sampling.logit_bias[5] == 1.0
    assert p.n_predict == 10 and p.stop == ["x"]


def test_seed(tok):
    assert parse({"seed": -1}, tok).sampling.seed == LLAMA_DEFAULT_SEED
    assert parse({}, tok).sampling.seed == LLAMA_DEFAULT_SEED
    assert parse({"seed": 2**32 + 5}, tok).sampling.seed == 5  # uint32_t


def test_bools_and_stream_options(tok):
    p = parse({"stream": True, "cache_prompt": False, "return_tokens": True,
               "timings_per_token": True, "post_sampling_probs": True,
               "stream_options": {"include_usage": True}}, tok)
    assert (p.stream, p.cache_prompt, p.return_tokens, p.timings_per_token,
            p.post_sampling_probs, p.include_usage) == (True, False, True, True, True, True)
    assert "Field 'include_usage'" in error_of({"stream_options": {"include_usage": 1}}, tok)
    assert "Field 'stream_options'" in error_of({"stream_options": True}, tok)


def test_logprobs_forms(tok):
    assert parse({"logprobs": 3}, tok).n_probs == 3  # /v1/completions: an int
    assert parse({"n_probs": 2, "logprobs": 3}, tok).n_probs == 2
    assert parse({"logprobs": True}, tok, oai_chat=True).n_probs == 20
    assert parse({"logprobs": True, "top_logprobs": 4}, tok, oai_chat=True).n_probs == 4
    assert parse({"logprobs": False}, tok, oai_chat=True).n_probs == 0
    assert "Field 'top_logprobs'" in error_of({"top_logprobs": 4}, tok, oai_chat=True)
    assert "Field 'top_logprobs'" in error_of({"logprobs": True, "top_logprobs": 21}, tok,
                                              oai_chat=True)
    assert "Field 'logprobs'" in error_of({"logprobs": 5}, tok, oai_chat=True)
    assert "Field 'logprobs'" in error_of({"logprobs": True}, tok)


# ---- fields with handlers -----------------------------------------------------------------------

def test_stop(tok):
    assert parse({"stop": "\n"}, tok).stop == ["\n"]
    assert parse({"stop": ["a", "", "b"]}, tok).stop == ["a", "b"]
    assert schema.parse_completion({"stop": []}, SlotParams(stop=["z"]), 4, 10, tok).stop == ["z"]
    for bad in (5, [1], {"a": "b"}, ["a", None]):
        assert "Field 'stop'" in error_of({"stop": bad}, tok)


def test_samplers(tok):
    assert parse({"samplers": ["top_k", "Top-P", "minp", "temp", "nope"]}, tok).sampling.samplers \
        == ["top_k", "top_p", "min_p", "temperature"]
    assert parse({"samplers": "edkypmxt"}, tok).sampling.samplers == [
        "penalties", "dry", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"]
    for bad in (5, [1, 2], {"top_k": 1}, ["infill"], "a"):
        assert "Field 'samplers'" in error_of({"samplers": bad}, tok)


def test_dry_sequence_breakers(tok):
    assert parse({"dry_sequence_breakers": ["."]}, tok).sampling.dry_sequence_breakers == ["."]
    for bad in ([], "x", [1], {}):
        assert "Field 'dry_sequence_breakers'" in error_of({"dry_sequence_breakers": bad}, tok)


def test_logit_bias_forms(tok):
    n = tok.n_vocab
    lb = parse({"logit_bias": [[15, 2.0], [16, False], [n, 1.0], [-1, 1.0], [17, True],
                               [18], "junk", [19, "x"]]}, tok).sampling.logit_bias
    assert lb == {15: 2.0, 16: -math.inf}
    lb = parse({"logit_bias": {"15": -1.5, "16": False, str(n): 3, "17": None}}, tok)
    assert lb.sampling.logit_bias == {15: -1.5, 16: -math.inf}
    words = tok.tokenize(" hello world", add_special=False)
    assert len(words) == 2
    for body in ({"logit_bias": [[" hello world", 1.0]]}, {"logit_bias": {" hello world": 1}}):
        assert parse(body, tok).sampling.logit_bias == {t: 1.0 for t in words}
    for bad in (5, "x", True):
        assert "Field 'logit_bias'" in error_of({"logit_bias": bad}, tok)


def test_ignore_eos_bans_every_eog_token(tok):
    p = parse({"ignore_eos": True, "logit_bias": [[15, 1.0]]}, tok)
    assert p.ignore_eos
    assert p.sampling.logit_bias == {15: 1.0, **{t: -math.inf for t in tok.eog_ids}}
    assert parse({"ignore_eos": False}, tok).sampling.logit_bias == {}


@pytest.mark.parametrize("body", [
    {"grammar": "root ::= x"}, {"json_schema": {}}, {"json_schema": {"type": "object"}},
    {"response_format": {"type": "json_object"}},
    {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
    {"response_format": {"type": "xml"}}, {"response_format": "json"},
    {"tools": [{"type": "function", "function": {"name": "f"}}]},
    {"tool_choice": "required"}, {"suffix": "x"}, {"suffix": ""}, {"echo": True},
    {"best_of": 2},
])
def test_unsupported_features_are_errors(tok, body):
    (name,) = body
    assert f"Field '{name}'" in error_of(body, tok)


def test_neutral_values_of_unsupported_fields_pass(tok):
    parse({"grammar": "", "response_format": {"type": "text"}, "tools": [],
           "tool_choice": "auto", "echo": False, "best_of": 1, "unknown_field": [1, 2]}, tok)


# ---- prompts ------------------------------------------------------------------------------------

def test_prompt_forms(tok):
    hello = tok.tokenize("Hello", add_special=True, parse_special=True)
    assert schema.parse_prompt("Hello", tok) == [hello]
    assert schema.parse_prompt([5, 6], tok) == [[5, 6]]
    assert schema.parse_prompt([5, "Hello"], tok) == [[5, *hello]]
    assert schema.parse_prompt(["Hello", [5, 6], [7, "Hello"]], tok) == [hello, [5, 6],
                                                                          [7, *hello]]
    assert schema.parse_prompt({"prompt_string": "Hello"}, tok) == [hello]
    assert schema.parse_prompt("<|im_start|>", tok) == [[1]]  # specials parsed
    assert schema.parse_prompt("", tok) == [[]]


@pytest.mark.parametrize("prompt", [
    None, [], 5, True, [1.5], [[1.5]], [None], [{"x": 1}], [5, None], [[5, "a", 2.0]],
    {"prompt_string": "x", "multimodal_data": ["AAAA"]}, [49152], [-1], [[0, -3]],
])
def test_bad_prompts(tok, prompt):
    with pytest.raises(InvalidRequest, match="Field 'prompt'"):
        schema.parse_prompt(prompt, tok)


def test_prompt_ids_are_checked(tok):
    with pytest.raises(InvalidRequest, match="token id 49152 out of range"):
        schema.parse_prompt([1, 49152], tok)


# ---- chat ---------------------------------------------------------------------------------------

def test_chat(tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": None}, {"role": "user", "content": [
                {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    ids = schema.parse_chat({"messages": msgs}, tok)
    text = tok.detokenize(ids, unparse_special=True)
    assert "Be brief." in text and "a\nb" in text and text.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("messages", [
    None, [], "hi", {"role": "user"}, [5], [{"content": "x"}], [{"role": "bot", "content": "x"}],
    [{"role": 1, "content": "x"}], [{"role": "user"}], [{"role": "user", "content": None}],
    [{"role": "user", "content": 5}], [{"role": "user", "content": [{"type": "text"}]}],
    [{"role": "user", "content": ["x"]}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}],
])
def test_bad_chat(tok, messages):
    with pytest.raises(InvalidRequest, match="Field 'messages'") as e:
        schema.parse_chat({"messages": messages}, tok)
    if "image" in json.dumps(messages) or "audio" in json.dumps(messages):
        assert "not supported" in str(e.value)


def test_chat_without_template(tok):
    bare = Tokenizer.from_gguf(default_model_path())
    bare.chat_template = None
    with pytest.raises(InvalidRequest, match="chat template"):
        schema.parse_chat({"messages": [{"role": "user", "content": "x"}]}, bare)


# ---- /tokenize, /detokenize ---------------------------------------------------------------------

def test_tokenize(tok):
    assert schema.parse_tokenize({"content": "Hello"}, tok) == {"tokens": [19556]}
    assert schema.parse_tokenize({"content": "<|im_start|>"}, tok) == {"tokens": [1]}
    assert schema.parse_tokenize({"content": "<|im_start|>", "parse_special": False},
                                 tok)["tokens"] != [1]
    assert schema.parse_tokenize({}, tok) == {"tokens": []}
    pieces = schema.parse_tokenize({"content": "é€", "with_pieces": True}, tok)["tokens"]
    assert b"".join(bytes(p["piece"]) if isinstance(p["piece"], list) else p["piece"].encode()
                    for p in pieces) == "é€".encode()
    for bad in ({"content": 5}, {"content": "x", "add_special": 1}, {"content": [None]},
                {"content": "x", "with_pieces": "yes"}):
        with pytest.raises(InvalidRequest, match="Field '"):
            schema.parse_tokenize(bad, tok)


def test_tokenize_pieces_that_are_not_utf8(tok):
    ids = [t for t in range(tok.n_vocab) if tok.token_to_piece(t) == b"\xe2"][:1]
    if ids:
        out = schema.parse_tokenize({"content": ids, "with_pieces": True}, tok)
        assert out == {"tokens": [{"id": ids[0], "piece": [0xE2]}]}


def test_detokenize(tok):
    assert schema.parse_detokenize({"tokens": [19556, 905]}, tok.n_vocab) == [19556, 905]
    assert schema.detokenize_response([19556, 905], tok) == {"content": "Hello world"}
    for bad in ({"tokens": "x"}, {"tokens": [1.5]}, {"tokens": [True]}, {"tokens": [-1]},
                {"tokens": [tok.n_vocab]}):
        with pytest.raises(InvalidRequest, match="Field 'tokens'"):
            schema.parse_detokenize(bad, tok.n_vocab)


# ---- filenames ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", [
    "../x", "a/b", "a\\b", "", ".", "..", "a..b", "x.", " x", "x ", "a\x00b", "a\nb", "\x7f",
    "a\x85b", "a:b", "a*b", "a?b", 'a"b', "a<b", "a>b", "a|b", "a\uff0eb", "a\u2215b",
    "a\u2216b", "a\ufffdb", "\ufeffa", "\ud800", "x" * 256, "é" * 128, None, 5, ["a"],
])
def test_bad_filenames(name):
    with pytest.raises(InvalidRequest, match="Invalid filename"):
        schema.validate_filename(name)


@pytest.mark.parametrize("name", ["slot1.bin", "x" * 255, "é" * 127, "a.b.c", ".hidden",
                                  "name with spaces", "日本語"])
def test_good_filenames(name):
    assert schema.validate_filename(name) == name


# ---- formats ------------------------------------------------------------------------------------

ENV = {"model": "smol", "cmpl_id": "chatcmpl-abc", "created": 1700000000}


def final(stop_type="eos", content="Hello", probs=(), index=0, **kw) -> Final:
    args = dict(task_id=1, index=index, id_slot=0, content=content, tokens=[7, 8],
                stop_type=stop_type, stopping_word="", n_decoded=2, n_prompt=10, n_cached=4,
                n_tokens_cached=12, truncated=False, has_new_line=False,
                timings=Timings(4, 6, 12.0, 2, 8.0), probs=list(probs))
    args.update(kw)
    return Final(**args)


def partial(content="He", n_decoded=1, probs=(), timings=None) -> Partial:
    return Partial(1, 0, 0, content, [7], list(probs), n_decoded, 10, timings)


PROBS = [TokenOutput(7, "é".encode()[:1], 0.5, [TokenProb(7, "é".encode()[:1], 0.5),
                                                 TokenProb(9, b"x", 0.0)])]


@pytest.mark.parametrize("stop_type, reason", [("eos", "stop"), ("word", "stop"),
                                                ("limit", "length"), ("none", "length")])
def test_finish_reason(stop_type, reason):
    assert formats.oai_chat_final(final(stop_type), **ENV)["choices"][0]["finish_reason"] == reason
    assert formats.oai_completion_final(final(stop_type), **ENV)["choices"][0][
        "finish_reason"] == reason
    chunks = formats.oai_chat_final_chunks(final(stop_type, content=""), **ENV)
    assert chunks[-1]["choices"][0]["finish_reason"] == reason


def test_usage_numbers():
    u = formats.usage(final())
    assert u == {"completion_tokens": 2, "prompt_tokens": 10, "total_tokens": 12,
                 "prompt_tokens_details": {"cached_tokens": 4}}


def test_probabilities():
    pre = formats.probs_json(PROBS, post_sampling=False)[0]
    assert set(pre) == {"id", "token", "bytes", "logprob", "top_logprobs"}
    assert pre["token"] == "" and pre["bytes"] == [0xC3]  # an incomplete character is cut
    assert pre["logprob"] == math.log(0.5)
    assert pre["top_logprobs"][1] == {"id": 9, "token": "x", "bytes": [120],
                                      "logprob": FLT_LOWEST}
    post = formats.probs_json(PROBS, post_sampling=True)[0]
    assert set(post) == {"id", "token", "bytes", "prob", "top_probs"}
    assert post["top_probs"][1]["prob"] == 0.0
    json.loads(formats.dumps(pre))  # the lowest float is valid JSON


def test_native_final_and_partial():
    out = formats.completion_final(final(probs=PROBS), SlotParams(n_probs=2), model="smol",
                                   prompt="p")
    for key in ("index", "content", "tokens", "id_slot", "stop", "model", "tokens_predicted",
                "tokens_evaluated", "generation_settings", "prompt", "has_new_line",
                "truncated", "stop_type", "stopping_word", "tokens_cached", "timings",
                "completion_probabilities"):
        assert key in out
    assert out["timings"]["prompt_n"] == 6 and out["timings"]["cache_n"] == 4
    streamed = formats.completion_final(final(probs=PROBS), SlotParams(stream=True),
                                        model="smol", prompt="p")
    assert "completion_probabilities" not in streamed
    p = formats.completion_partial(partial(probs=PROBS, timings=Timings()))
    assert p["stop"] is False and "timings" in p and len(p["completion_probabilities"]) == 1
    settings = formats.generation_settings(
        parse({"ignore_eos": True}, Tokenizer.from_gguf(default_model_path())))
    assert {"bias": None, "token": 2} in settings["logit_bias"]  # -inf as nlohmann: null
    json.loads(formats.dumps(settings))


def test_oai_completion():
    out = formats.oai_completion_final(final(probs=PROBS), **ENV)
    assert out["object"] == "text_completion" and out["id"] == ENV["cmpl_id"]
    assert set(out) >= {"choices", "created", "model", "system_fingerprint", "usage"}
    assert out["choices"][0]["text"] == "Hello"
    assert out["choices"][0]["logprobs"]["content"][0]["id"] == 7
    assert formats.oai_completion_final(final(probs=PROBS), **ENV, stream=True)["choices"][0][
        "logprobs"] is None
    chunk = formats.oai_completion_partial(partial(), **ENV)
    assert chunk["choices"][0]["finish_reason"] is None and "usage" not in chunk


def test_oai_chat():
    out = formats.oai_chat_final(final(probs=PROBS), **ENV)
    assert out["object"] == "chat.completion"
    assert out["choices"][0]["message"] == {"role": "assistant", "content": "Hello"}
    assert out["choices"][0]["logprobs"]["content"][0]["top_logprobs"][0]["id"] == 7
    first = formats.oai_chat_partial(partial(probs=PROBS), **ENV)
    assert [c["choices"][0]["delta"] for c in first] == [
        {"role": "assistant", "content": None}, {"content": "He"}]
    assert all(c["object"] == "chat.completion.chunk" for c in first)
    assert "logprobs" in first[-1]["choices"][0] and "logprobs" not in first[0]["choices"][0]
    later = formats.oai_chat_partial(partial("llo", 2), **ENV)
    assert [c["choices"][0]["delta"] for c in later] == [{"content": "llo"}]
    end = formats.oai_chat_final_chunks(final(content="!"), **ENV, include_usage=True)
    assert [c["choices"] for c in end[:2]] == [
        [{"finish_reason": None, "index": 0, "delta": {"content": "!"}}],
        [{"finish_reason": "stop", "index": 0, "delta": {}}]]
    assert end[2]["choices"] == [] and end[2]["usage"]["total_tokens"] == 12
    assert "timings" in end[-1] and "timings" not in end[0]
    assert len(formats.oai_chat_final_chunks(final(content=""), **ENV)) == 1


def test_merging_several_results():
    """Several choices: one OpenAI object with every choice, or an array of native ones."""
    fins = [final(index=i, content=str(i)) for i in range(3)]
    chat = formats.merge_results([formats.oai_chat_final(f, **ENV) for f in fins], oai=True)
    assert [(c["index"], c["message"]["content"]) for c in chat["choices"]] == [
        (0, "0"), (1, "1"), (2, "2")]
    cmpl = formats.merge_results([formats.oai_completion_final(f, **ENV) for f in fins],
                                 oai=True)
    assert [c["text"] for c in cmpl["choices"]] == ["0", "1", "2"]
    native = [formats.completion_final(f, SlotParams(), model="m", prompt="") for f in fins]
    assert [o["content"] for o in formats.merge_results(native, oai=False)] == ["0", "1", "2"]


def test_stream_envelope_of_the_app():
    """The app's chat stream opens with a role delta per choice and, with include_usage,
    ends with a usage chunk counting every prompt once."""
    params = SlotParams(stream=True, include_usage=True, n_cmpl=2)
    meta = Meta(OAI_CHAT, "m", 1, "chatcmpl-x", params, {}, None)

    class T:
        def __init__(self, index):
            self.index = index
    start = meta.start([T(1), T(0)])
    assert [c["choices"][0]["index"] for c in start] == [0, 1]
    assert start[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    end = meta.end([final(index=0), final(index=1)])
    assert end[0]["choices"] == [] and end[0]["usage"]["prompt_tokens"] == final().n_prompt
    assert end[0]["usage"]["completion_tokens"] == 2 * final().n_decoded
    assert Meta(NATIVE, "m", 1, "x", params, {}, None).start([T(0)]) == []


def test_sse():
    assert formats.sse({"a": "é"}) == 'data: {"a":"é"}\n\n'.encode()
    assert formats.SSE_DONE == b"data: [DONE]\n\n"
    with pytest.raises(ValueError):
        formats.sse({"a": math.inf})


# ---- the corpus of malformed requests -----------------------------------------------------------

def test_corpus_shape():
    cases = malformed_requests()
    assert len(cases) >= 200
    assert {s for *_, s in cases} <= {400, 404, 405, 413}
    for method, path, body, _ in cases:
        assert method in ("GET", "POST", "PUT", "DELETE", "PATCH") and path.startswith("/")
        assert isinstance(body, bytes | dict)


def test_corpus_bodies_fail_our_parsers(tok):
    """Every 400 completion/chat case of the corpus is refused by the parsers alone."""
    checked = 0
    for method, path, body, status in malformed_requests():
        if status != 400 or method != "POST" or path not in (
                "/completion", "/v1/completions", "/v1/chat/completions"):
            continue
        with pytest.raises(InvalidRequest):
            if isinstance(body, bytes):
                body = schema.parse_json(body, 1 << 20)
            chat = path == "/v1/chat/completions"
            schema.parse_completion(body, SlotParams(), 4, tok.n_vocab, tok, oai_chat=chat)
            prompts = (schema.parse_chat(body, tok) if chat
                       else schema.parse_prompt(body.get("prompt"), tok))
            for p in ([prompts] if chat else prompts):
                if len(p) >= 256:
                    raise InvalidRequest("exceeds the context (-c 256)")
        checked += 1
    assert checked >= 150


# ---- issue 31: sampler values, bounded requests, valid JSON, llama-server parity --------------

@pytest.mark.parametrize("value", [1e-310, 1e-39, 0.0, -1.0, 1e39])
def test_a_repeat_penalty_the_sampler_cannot_divide_by_is_refused(tok, value):
    message = error_of({"repeat_penalty": value}, tok)
    assert message.startswith("Field 'repeat_penalty': value must be between 1.1754944e-38 "
                              "<= value <= 3.4028235e+38")


@pytest.mark.parametrize("value", [1.1754943508222875e-38, 1e-30, 1.1, 1e30])
def test_a_repeat_penalty_in_range_passes(tok, value):
    assert parse({"repeat_penalty": value}, tok).sampling.penalty_repeat == value


@pytest.mark.parametrize("body, name, message", [
    ({"n_probs": 101}, "n_probs", "value must be between 0 <= value <= 100"),
    ({"n_probs": 100000}, "n_probs", "value must be between 0 <= value <= 100"),
    ({"logprobs": 500}, "logprobs", "value must be between 0 <= value <= 100"),
    ({"logit_bias": [[i, 1.0] for i in range(1025)]}, "logit_bias",
     "at most 1024 entries are accepted, got 1025"),
    ({"logit_bias": {str(i): 1.0 for i in range(1025)}}, "logit_bias",
     "at most 1024 entries are accepted, got 1025"),
    ({"logit_bias": {"x" * 257: 1.0}}, "logit_bias",
     "at most 256 characters per text key are accepted, got 257"),
    ({"stop": [f"s{i}" for i in range(17)]}, "stop", "at most 16 strings are accepted, got 17"),
    ({"stop": "y" * 257}, "stop", "at most 256 characters per string are accepted, got 257"),
    ({"dry_sequence_breakers": ["a"] * 17}, "dry_sequence_breakers",
     "at most 16 strings are accepted, got 17"),
    ({"samplers": ["top_k"] * 33}, "samplers", "at most 32 entries are accepted, got 33"),
    ({"samplers": "k" * 33}, "samplers", "at most 32 characters are accepted, got 33"),
])
def test_every_per_request_allocation_is_bounded(tok, body, name, message):
    assert error_of(body, tok).startswith(f"Field '{name}': {message}")


def test_the_limits_themselves_pass(tok):
    p = parse({"n_probs": 100, "logit_bias": [[i, 0.5] for i in range(1024)],
               "stop": ["z" * 256] * 16, "dry_sequence_breakers": ["b"] * 16,
               "samplers": ["top_k"] * 32}, tok)
    assert (p.n_probs, len(p.sampling.logit_bias), len(p.stop)) == (100, 1024, 16)
    assert parse({"logprobs": True, "top_logprobs": 20}, tok, oai_chat=True).n_probs == 20


@pytest.mark.parametrize("key, expected", [
    ("²", "²"), ("--5", "--5"), ("5a", "5a"), ("+", "+"), ("٣", "٣"), ("7", 7), (" 7", 7),
    ("+7", 7), ("-7", -7), ("", 0),
])
def test_logit_bias_keys_are_read_as_strtol_reads_them(key, expected):
    assert schema.bias_key(key) == expected


def test_logit_bias_keys_that_are_not_ids_are_text(tok):
    for key in ("²", "--5"):
        biases = parse({"logit_bias": {key: 1}}, tok).sampling.logit_bias
        assert biases == dict.fromkeys(tok.tokenize(key, add_special=False,
                                                    parse_special=False), 1.0)
    assert parse({"logit_bias": {"-5": 1}}, tok).sampling.logit_bias == {}  # out of range


@pytest.mark.parametrize("prompt", [
    [[1, 2], "x", {"prompt_string": 5}], {"prompt_string": None}, {"prompt_string": {"a": 1}},
    [{"prompt_string": [1, {"x": 2}]}],
])
def test_a_prompt_string_of_the_wrong_type_is_a_400(tok, prompt):
    with pytest.raises(InvalidRequest, match="Field 'prompt'"):
        schema.parse_prompt(prompt, tok)


def test_non_finite_probabilities_are_reported_finite():
    """A chain whose logits overflowed reports NaN probabilities (as llama.cpp's would); the
    JSON says 0 for them (a logprob of the lowest float), never NaN."""
    nan = float("nan")
    probs = [TokenOutput(5, b"Hi", nan, [TokenProb(5, b"Hi", nan), TokenProb(6, b"x", 1.5)])]
    for post in (True, False):
        out = formats.probs_json(probs, post)
        json.loads(formats.dumps(out))
    post = formats.probs_json(probs, True)[0]
    assert (post["prob"], post["top_probs"][0]["prob"], post["top_probs"][1]["prob"]) == (
        0.0, 0.0, 1.0)
    assert formats.probs_json(probs, False)[0]["logprob"] == FLT_LOWEST


def test_tokens_are_reported_only_when_asked():
    """``/completion``: ``tokens`` is ``[]`` unless ``return_tokens`` (llama.cpp)."""
    fin = final()
    assert formats.completion_final(fin, SlotParams(), model="m", prompt="p")["tokens"] == []
    asked = formats.completion_final(fin, SlotParams(return_tokens=True), model="m", prompt="p")
    assert asked["tokens"] == fin.tokens != []
    part = partial()
    assert formats.completion_partial(part)["tokens"] == part.tokens  # the default: asked
    part.return_tokens = False
    assert formats.completion_partial(part)["tokens"] == []


def test_the_usage_chunk_carries_the_timings():
    chunk = formats.usage_chunk("chat.completion.chunk", model="m", cmpl_id="c", created=1,
                                usage={"total_tokens": 9},
                                timings=Timings(predicted_n=3, predicted_ms=4.0))
    assert chunk["choices"] == [] and chunk["usage"] == {"total_tokens": 9}
    assert chunk["timings"]["predicted_n"] == 3
    assert chunk["system_fingerprint"] == formats.SYSTEM_FINGERPRINT


@pytest.mark.parametrize("n, ms, per_second", [(0, 0.0, 0.0), (1, 7.0, 0.0), (2, 4.0, 250.0),
                                               (5, 8.0, 500.0), (3, 0.0, 0.0)])
def test_predicted_per_second_counts_decode_steps(n, ms, per_second):
    """The generation clock starts at the first token: ``n`` tokens took ``n - 1`` steps."""
    t = formats.timings_json(Timings(predicted_n=n, predicted_ms=ms))
    assert t["predicted_per_second"] == per_second


def test_system_fingerprint_is_the_build_info():
    from reference import __version__
    fp = formats.SYSTEM_FINGERPRINT
    assert fp.startswith(f"b{__version__}-")
    commit = fp.rsplit("-", 1)[1]
    assert commit == "unknown" or (len(commit) == 7 and all(c in "0123456789abcdef"
                                                             for c in commit))
    assert formats.build_info("1.2.3", None) == "b1.2.3-unknown"


def test_system_fingerprint_reads_the_checkout(tmp_path):
    git = tmp_path / ".git"
    (git / "refs" / "heads").mkdir(parents=True)
    (git / "HEAD").write_text("ref: refs/heads/main\n")
    (git / "refs" / "heads" / "main").write_text("0123456789abcdef0123456789abcdef01234567\n")
    (tmp_path / "pkg").mkdir()
    assert formats._git_commit(tmp_path / "pkg") == "0123456"
    (git / "refs" / "heads" / "main").unlink()
    (git / "packed-refs").write_text("# pack-refs\nfedcba9876543210fedcba9876543210fedcba98 "
                                     "refs/heads/main\n")
    assert formats._git_commit(tmp_path / "pkg") == "fedcba9"
    (git / "HEAD").write_text("ref: refs/heads/gone\n")
    assert formats._git_commit(tmp_path / "pkg") is None


# ---- chat: assistant prefill as llama-server ------------------------------------------------

def chat_text(tok, ids) -> str:
    return tok.detokenize(ids, unparse_special=True)


def test_a_final_assistant_message_is_continued(tok):
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, I"}]
    ids = schema.parse_chat({"messages": msgs}, tok)
    expected = tok.apply_chat_template(msgs[:1], True) + "Hello, I"
    assert ids == tok.tokenize(expected, add_special=True, parse_special=True)
    assert chat_text(tok, ids).endswith("<|im_start|>assistant\nHello, I")


def test_two_assistant_messages_at_the_end_are_refused(tok):
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "A"},
            {"role": "assistant", "content": "B"}]
    with pytest.raises(InvalidRequest) as e:
        schema.parse_chat({"messages": msgs}, tok)
    assert str(e.value) == "Cannot have 2 or more assistant messages at the end of the list."


@pytest.mark.parametrize("body", [
    {"continue_final_message": True},
    {"continue_final_message": True, "add_generation_prompt": True},
])
def test_generation_prompt_and_continuation_together_are_refused(tok, body):
    msgs = [{"role": "user", "content": "Hi"}]
    with pytest.raises(InvalidRequest) as e:
        schema.parse_chat({"messages": msgs, **body}, tok)
    assert str(e.value) == ("Cannot set both add_generation_prompt and continue_final_message "
                            "to true.")


def test_continuing_and_not_prompting(tok):
    msgs = [{"role": "user", "content": "Tell me"}]
    cont = schema.parse_chat({"messages": msgs, "continue_final_message": True,
                              "add_generation_prompt": False}, tok)
    assert chat_text(tok, cont).endswith("<|im_start|>user\nTell me")
    plain = schema.parse_chat({"messages": msgs, "add_generation_prompt": False}, tok)
    assert chat_text(tok, plain).endswith("Tell me<|im_end|>\n")
    with pytest.raises(InvalidRequest, match="Field 'add_generation_prompt'"):
        schema.parse_chat({"messages": msgs, "add_generation_prompt": "no"}, tok)
