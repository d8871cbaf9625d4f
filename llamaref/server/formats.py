r"""Results to llama.cpp's JSON: the native, OpenAI completion and OpenAI chat formats.

Pure functions from the scheduler's result dataclasses
([`Partial`][reference.tools.server.results.Partial],
[`Final`][reference.tools.server.results.Final]) to the objects llama.cpp sends
(``tools/server/server-task.cpp``):

- **native** ``/completion``: ``to_json_non_oaicompat`` of a final (``:340-363``) or partial
  (``:1049-1071``) result, with ``completion_probabilities`` (``probs_vector_to_json``,
  ``:282-307``);
- **OpenAI** ``/v1/completions``: ``text_completion`` objects (``:374-412``, ``:1073-1109``), the
  same shape streamed, ``logprobs`` as llama.cpp writes it (``{"content": [...]}``);
- **OpenAI chat**: ``chat.completion`` (``:414-460``) and its stream of
  ``chat.completion.chunk`` (``:462-526``, ``:1111-1164``): the first token's chunk opens with
  ``{"role": "assistant", "content": null}``, then content deltas, then a chunk with the
  ``finish_reason`` and an empty delta, then (``stream_options.include_usage``) a chunk with
  ``choices: []`` and the ``usage``.

``finish_reason`` is ``"stop"`` for an end-of-generation token or a stop string and
``"length"`` otherwise. A probability is reported as ``logprob`` (``log p``; ``p = 0`` gives the
lowest float, since JSON has no ``-inf``) or, with ``post_sampling_probs``, as ``prob``; a
token's ``token`` text is its bytes cut before an incomplete UTF-8 character (``validate_utf8``)
and its ``bytes`` the full list.

Several results of one request (``n > 1``, several prompts) are merged as llama.cpp does
(``server-context.cpp:4336-4352``): native ones into an array, OpenAI ones into the first
object's ``choices`` (its ``usage`` stays the first result's).
"""

from __future__ import annotations

import json
import math
import secrets
import string
from pathlib import Path

from reference import __version__
from reference.tools.server.params import SlotParams
from reference.tools.server.results import (
    Final,
    Partial,
    Timings,
    TokenOutput,
    TokenProb,
    logarithm,
)


def _git_commit(start: Path) -> str | None:
    """The short commit of the git checkout holding ``start`` (read from ``.git``, no git
    program needed), or None outside a checkout."""
    for folder in (start, *start.parents):
        git = folder / ".git"
        if not git.is_dir():
            continue
        try:
            head = (git / "HEAD").read_text().strip()
            if head.startswith("ref: "):
                ref = head[5:]
                loose = git / ref
                if loose.is_file():
                    head = loose.read_text().strip()
                else:
                    packed = (git / "packed-refs").read_text().splitlines()
                    head = next(line.split()[0] for line in packed
                                if line.endswith(" " + ref))
        except (OSError, StopIteration):
            return None
        return head[:7] if len(head) >= 7 and all(c in string.hexdigits for c in head) else None
    return None


def build_info(version: str, commit: str | None) -> str:
    """llama.cpp's ``build_info``, ``"b<build>-<commit>"``: here the project's version and
    the checkout's short commit (``"unknown"`` outside a git checkout, as llama.cpp's build
    says when it has no git).

    Examples:
        >>> build_info("0.1.0", "d95f5b2"), build_info("0.1.0", None)
        ('b0.1.0-d95f5b2', 'b0.1.0-unknown')
    """
    return f"b{version}-{commit or 'unknown'}"


#: ``system_fingerprint``: llama.cpp writes its ``build_info`` there; computed once
SYSTEM_FINGERPRINT = build_info(__version__, _git_commit(Path(__file__).resolve().parent))

#: the end of an OpenAI stream
SSE_DONE = b"data: [DONE]\n\n"


# ---------------------------------------------------------------------------------------------
# the wire
# ---------------------------------------------------------------------------------------------

def dumps(obj) -> str:
    """Compact JSON, non-ASCII kept (``safe_json_to_str``); NaN and infinities are an error,
    never invalid JSON.

    Examples:
        >>> dumps({"a": "é", "b": [1, 2]})
        '{"a":"é","b":[1,2]}'
    """
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def sse(obj) -> bytes:
    r"""One server-sent event: ``data: <json>\n\n`` (``format_oai_sse``); a list of chunks
    becomes one event per chunk.

    Examples:
        >>> sse({"content": "Hi"})
        b'data: {"content":"Hi"}\n\n'
        >>> sse([{"a": 1}, {"b": 2}])
        b'data: {"a":1}\n\ndata: {"b":2}\n\n'
    """
    if isinstance(obj, list):
        return b"".join(sse(o) for o in obj)
    return f"data: {dumps(obj)}\n\n".encode()


def gen_cmpl_id(chat: bool = True) -> str:
    """``gen_chatcmplid``: ``"chatcmpl-"`` (``"cmpl-"`` for a text completion, as OpenAI
    names them) and 32 random letters and digits.

    Examples:
        >>> i = gen_cmpl_id(); i.startswith("chatcmpl-"), len(i)
        (True, 41)
        >>> gen_cmpl_id(chat=False).startswith("cmpl-")
        True
    """
    alphabet = string.digits + string.ascii_uppercase + string.ascii_lowercase
    return ("chatcmpl-" if chat else "cmpl-") + "".join(
        secrets.choice(alphabet) for _ in range(32))


# ---------------------------------------------------------------------------------------------
# probabilities
# ---------------------------------------------------------------------------------------------

def validate_utf8(data: bytes) -> int:
    """``validate_utf8`` (``server-common.cpp:901-925``): the length of ``data`` without a
    multi-byte character cut off at its end.

    Examples:
        >>> validate_utf8("é".encode()), validate_utf8("é".encode()[:1]), validate_utf8(b"ab")
        (2, 0, 2)
    """
    n = len(data)
    for i in range(1, min(4, n) + 1):
        c = data[n - i]
        if ((c & 0xE0) == 0xC0 and i < 2) or ((c & 0xF0) == 0xE0 and i < 3) or (
                (c & 0xF8) == 0xF0 and i < 4):
            return n - i
    return n


def token_text(piece: bytes) -> str:
    """A token's ``token`` text: its bytes up to an incomplete trailing character, other
    invalid UTF-8 replaced by U+FFFD (as ``safe_json_to_str``).

    Examples:
        >>> token_text(b" world"), token_text("\u00e9".encode()[:1])
        (' world', '')
    """
    return piece[: validate_utf8(piece)].decode("utf-8", "replace")


def finite_prob(prob: float) -> float:
    """A probability JSON can carry: a NaN (a sampler chain whose logits overflowed, e.g.
    ``temperature: 1e-40`` or two ``1e300`` biases, as llama.cpp's would) is reported as 0,
    anything else is clamped to [0, 1].

    Examples:
        >>> finite_prob(float("nan")), finite_prob(float("inf")), finite_prob(0.25)
        (0.0, 1.0, 0.25)
    """
    return 0.0 if math.isnan(prob) else min(max(float(prob), 0.0), 1.0)


def _prob_fields(prob: float, post_sampling: bool) -> tuple[str, float]:
    prob = finite_prob(prob)
    return ("prob", prob) if post_sampling else ("logprob", logarithm(prob))


def candidate_json(p: TokenProb, post_sampling: bool) -> dict:
    """One of a token's top candidates (``completion_token_output::to_json``, ``:264-280``).

    Examples:
        >>> candidate_json(TokenProb(5, b"Hi", 0.0), False)
        {'id': 5, 'token': 'Hi', 'bytes': [72, 105], 'logprob': -3.4028234663852886e+38}
    """
    key, value = _prob_fields(p.prob, post_sampling)
    return {"id": p.id, "token": token_text(p.piece), "bytes": list(p.piece), key: value}


def probs_json(probs: list[TokenOutput], post_sampling: bool) -> list[dict]:
    """``completion_token_output::probs_vector_to_json`` (``server-task.cpp:282-307``): per
    generated token its id, text, bytes, ``logprob`` (or ``prob``) and ``top_logprobs`` (or
    ``top_probs``).

    Args:
        probs: the generated tokens with their candidates.
        post_sampling: the request's ``post_sampling_probs``.

    Returns:
        The list for ``completion_probabilities`` or ``logprobs.content``.

    Examples:
        >>> out = probs_json([TokenOutput(5, b"Hi", 1.0, [TokenProb(5, b"Hi", 1.0)])], True)
        >>> out[0]["prob"], out[0]["top_probs"][0]["prob"], sorted(out[0])
        (1.0, 1.0, ['bytes', 'id', 'prob', 'token', 'top_probs'])
    """
    top_key = "top_probs" if post_sampling else "top_logprobs"
    out = []
    for t in probs:
        key, value = _prob_fields(t.prob, post_sampling)
        out.append({"id": t.id, "token": token_text(t.piece), "bytes": list(t.piece),
                    key: value, top_key: [candidate_json(c, post_sampling) for c in t.top]})
    return out


# ---------------------------------------------------------------------------------------------
# native /completion
# ---------------------------------------------------------------------------------------------

def _finite(x: float) -> float | None:
    """A float JSON can carry (nlohmann writes ``-inf`` as ``null``)."""
    return x if math.isfinite(x) else None


def predicted_per_second(n: int, ms: float) -> float:
    """Generation speed as llama.cpp reports it: the clock starts when the first token is
    sampled, so ``ms`` covers ``n - 1`` decode steps; one token (or none) reports 0.0.

    Examples:
        >>> predicted_per_second(1, 5.0), predicted_per_second(5, 8.0)
        (0.0, 500.0)
    """
    return 1e3 * (n - 1) / ms if n > 1 and ms > 0 else 0.0


def timings_json(t: Timings) -> dict:
    """llama.cpp's ``timings`` object (``result_timings::to_json``): the counts and times,
    with the per-token ms and the tokens per second derived.

    Examples:
        >>> timings_json(Timings(prompt_n=4, prompt_ms=8.0))["prompt_per_second"]
        500.0
    """
    def per(n, ms):
        return (ms / n if n else 0.0), (1e3 * n / ms if ms > 0 else 0.0)
    p_tok, p_sec = per(t.prompt_n, t.prompt_ms)
    g_tok, _ = per(t.predicted_n, t.predicted_ms)
    g_sec = predicted_per_second(t.predicted_n, t.predicted_ms)
    return {"cache_n": t.cache_n, "prompt_n": t.prompt_n,
            "prompt_ms": t.prompt_ms, "prompt_per_token_ms": p_tok,
            "prompt_per_second": p_sec, "predicted_n": t.predicted_n,
            "predicted_ms": t.predicted_ms, "predicted_per_token_ms": g_tok,
            "predicted_per_second": g_sec}


def generation_settings(params: SlotParams) -> dict:
    """``task_params::to_json`` (``server-task.cpp:30-175``), the fields a [`SlotParams`][]
    holds.

    Examples:
        >>> g = generation_settings(SlotParams())
        >>> g["temperature"], g["n_predict"], g["samplers"][:2]
        (0.8, -1, ['penalties', 'dry'])
    """
    s = params.sampling
    return {
        "seed": s.seed, "temperature": s.temp, "dynatemp_range": s.dynatemp_range,
        "dynatemp_exponent": s.dynatemp_exponent, "top_k": s.top_k, "top_p": s.top_p,
        "min_p": s.min_p, "top_n_sigma": s.top_n_sigma, "xtc_probability": s.xtc_probability,
        "xtc_threshold": s.xtc_threshold, "typical_p": s.typ_p,
        "repeat_last_n": s.penalty_last_n, "repeat_penalty": s.penalty_repeat,
        "presence_penalty": s.penalty_present, "frequency_penalty": s.penalty_freq,
        "dry_multiplier": s.dry_multiplier, "dry_base": s.dry_base,
        "dry_allowed_length": s.dry_allowed_length, "dry_penalty_last_n": s.dry_penalty_last_n,
        "dry_sequence_breakers": list(s.dry_sequence_breakers), "mirostat": s.mirostat,
        "mirostat_tau": s.mirostat_tau, "mirostat_eta": s.mirostat_eta,
        "stop": list(params.stop), "max_tokens": params.n_predict,
        "n_predict": params.n_predict, "n_keep": params.n_keep, "n_discard": params.n_discard,
        "ignore_eos": params.ignore_eos, "stream": params.stream,
        "logit_bias": [{"bias": _finite(b), "token": t} for t, b in s.logit_bias.items()],
        "n_probs": params.n_probs, "min_keep": s.min_keep, "samplers": list(s.samplers),
        "timings_per_token": params.timings_per_token,
        "post_sampling_probs": params.post_sampling_probs,
    }


# --8<-- [start:completion_json]
def completion_final(res: Final, params: SlotParams, *, model: str, prompt: str) -> dict:
    """The native ``/completion`` answer (``to_json_non_oaicompat``, ``server-task.cpp:340``);
    also the last event of a native stream (then without ``completion_probabilities``: they
    went with the partial results). ``tokens`` is empty unless the request asked for
    ``return_tokens``, as in llama.cpp.

    Args:
        res: the final result.
        params: the request's parameters (``generation_settings``, ``stream``,
            ``post_sampling_probs``).
        model: the model name.
        prompt: the prompt as text.

    Returns:
        The object.

    Examples:
        >>> from reference.tools.server.results import Timings
        >>> fin = Final(0, 0, 1, "Hi!", [7, 8], "eos", "", 2, 5, 3, 7, False, False, Timings())
        >>> out = completion_final(fin, SlotParams(), model="m", prompt="Say hi")
        >>> out["stop"], out["stop_type"], out["tokens_predicted"], out["tokens_cached"]
        (True, 'eos', 2, 7)
    """
    out = {
        "index": res.index, "content": res.content,
        "tokens": list(res.tokens) if params.return_tokens else [],
        "id_slot": res.id_slot, "stop": True, "model": model, "tokens_predicted": res.n_decoded,
        "tokens_evaluated": res.n_prompt, "generation_settings": generation_settings(params),
        "prompt": prompt, "has_new_line": res.has_new_line, "truncated": res.truncated,
        "stop_type": res.stop_type, "stopping_word": res.stopping_word,
        "tokens_cached": res.n_tokens_cached, "timings": timings_json(res.timings),
    }
    if not params.stream and res.probs:
        out["completion_probabilities"] = probs_json(res.probs, params.post_sampling_probs)
    return out


def completion_partial(res: Partial, post_sampling: bool = False) -> dict:
    """One native stream event (``server-task.cpp:1049-1071``): new text, ``stop: false``,
    the token's probabilities, and ``timings`` with ``timings_per_token``.

    Examples:
        >>> out = completion_partial(Partial(0, 0, 1, "Hi", [7], [], 1, 5))
        >>> out["content"], out["stop"], "timings" in out
        ('Hi', False, False)
    """
    out = {"index": res.index, "content": res.content,
           "tokens": list(res.tokens) if res.return_tokens else [], "stop": False,
           "id_slot": res.id_slot, "tokens_predicted": res.n_decoded,
           "tokens_evaluated": res.n_prompt}
    if res.timings is not None:
        out["timings"] = timings_json(res.timings)
    if res.probs:
        out["completion_probabilities"] = probs_json(res.probs, post_sampling)
    return out
# --8<-- [end:completion_json]


# ---------------------------------------------------------------------------------------------
# OpenAI /v1/completions
# ---------------------------------------------------------------------------------------------

def finish_reason(stop_type: str) -> str:
    """``"stop"`` for an end-of-generation token or a stop string, ``"length"`` otherwise.

    Examples:
        >>> [finish_reason(s) for s in ("eos", "word", "limit", "none")]
        ['stop', 'stop', 'length', 'length']
    """
    return "stop" if stop_type in ("eos", "word") else "length"


def usage(res: Final) -> dict:
    """``usage_json_oaicompat`` (``server-task.cpp:365-372``).

    Examples:
        >>> from reference.tools.server.results import Timings
        >>> usage(Final(0, 0, 0, "", [], "eos", "", 4, 10, 6, 14, False, False, Timings()))
        {'completion_tokens': 4, 'prompt_tokens': 10, 'total_tokens': 14, \
'prompt_tokens_details': {'cached_tokens': 6}}
    """
    return {"completion_tokens": res.n_decoded, "prompt_tokens": res.n_prompt,
            "total_tokens": res.n_decoded + res.n_prompt,
            "prompt_tokens_details": {"cached_tokens": res.n_cached}}


def _envelope(obj: str, model: str, cmpl_id: str, created: int) -> dict:
    return {"created": created, "model": model, "system_fingerprint": SYSTEM_FINGERPRINT,
            "object": obj, "id": cmpl_id}


def oai_completion_final(
    res: Final, *, model: str, cmpl_id: str, created: int, stream: bool = False,
    post_sampling: bool = False,
) -> dict:
    """A ``text_completion`` object (``to_json_oaicompat``, ``server-task.cpp:374-412``): the
    answer, or the last chunk of a stream (then ``logprobs`` is null: it went with the
    partial chunks). ``usage`` and ``timings`` are always there.

    Examples:
        >>> from reference.tools.server.results import Timings
        >>> fin = Final(0, 0, 0, "Hi", [7], "limit", "", 1, 3, 0, 4, False, False, Timings())
        >>> out = oai_completion_final(fin, model="m", cmpl_id="chatcmpl-x", created=1)
        >>> out["object"], out["choices"], out["usage"]["total_tokens"]
        ('text_completion', [{'text': 'Hi', 'index': 0, 'logprobs': None, \
'finish_reason': 'length'}], 4)
    """
    logprobs = None
    if not stream and res.probs:
        logprobs = {"content": probs_json(res.probs, post_sampling)}
    choice = {"text": res.content, "index": res.index, "logprobs": logprobs,
              "finish_reason": finish_reason(res.stop_type)}
    return {"choices": [choice], **_envelope("text_completion", model, cmpl_id, created),
            "usage": usage(res), "timings": timings_json(res.timings)}


def oai_completion_partial(
    res: Partial, *, model: str, cmpl_id: str, created: int, post_sampling: bool = False,
) -> dict:
    """One ``text_completion`` stream chunk (``server-task.cpp:1073-1109``),
    ``finish_reason: null``.

    Examples:
        >>> out = oai_completion_partial(Partial(0, 1, 0, "Hi", [7], [], 1, 3), model="m",
        ...                              cmpl_id="c", created=1)
        >>> out["choices"]
        [{'text': 'Hi', 'index': 1, 'logprobs': None, 'finish_reason': None}]
    """
    logprobs = {"content": probs_json(res.probs, post_sampling)} if res.probs else None
    choice = {"text": res.content, "index": res.index, "logprobs": logprobs,
              "finish_reason": None}
    out = {"choices": [choice], **_envelope("text_completion", model, cmpl_id, created)}
    if res.timings is not None:
        out["timings"] = timings_json(res.timings)
    return out


# ---------------------------------------------------------------------------------------------
# OpenAI chat
# ---------------------------------------------------------------------------------------------

# --8<-- [start:oai_chat]
def oai_chat_final(
    res: Final, *, model: str, cmpl_id: str, created: int, post_sampling: bool = False,
) -> dict:
    """A ``chat.completion`` object (``to_json_oaicompat_chat``, ``server-task.cpp:414-460``).

    Examples:
        >>> from reference.tools.server.results import Timings
        >>> fin = Final(0, 0, 0, "Hello", [7], "eos", "", 1, 9, 0, 10, False, False, Timings())
        >>> out = oai_chat_final(fin, model="m", cmpl_id="chatcmpl-x", created=1)
        >>> out["object"], out["choices"]
        ('chat.completion', [{'finish_reason': 'stop', 'index': 0, 'message': {'role': \
'assistant', 'content': 'Hello'}}])
    """
    choice = {"finish_reason": finish_reason(res.stop_type), "index": res.index,
              "message": {"role": "assistant", "content": res.content}}
    if res.probs:
        choice["logprobs"] = {"content": probs_json(res.probs, post_sampling)}
    return {"choices": [choice], **_envelope("chat.completion", model, cmpl_id, created),
            "usage": usage(res), "timings": timings_json(res.timings)}


def _chunk(index: int, delta: dict, reason: str | None, head: dict) -> dict:
    choice = {"finish_reason": reason, "index": index, "delta": delta}
    return {"choices": [choice], **head}


def oai_chat_partial(
    res: Partial, *, model: str, cmpl_id: str, created: int, post_sampling: bool = False,
    send_role: bool | None = None,
) -> list[dict]:
    """The ``chat.completion.chunk`` objects of one partial result
    (``server-task.cpp:1111-1164``): for the first token a ``{"role": "assistant",
    "content": null}`` delta, then the content delta (none when the text is held back);
    ``logprobs`` and ``timings`` go with the last chunk. An empty list sends nothing.
    ``send_role`` overrides the first-token rule (a stream that opened with the role delta
    already passes False).

    Examples:
        >>> chunks = oai_chat_partial(Partial(0, 0, 0, "Hi", [7], [], 1, 3), model="m",
        ...                           cmpl_id="c", created=1)
        >>> [c["choices"][0]["delta"] for c in chunks]
        [{'role': 'assistant', 'content': None}, {'content': 'Hi'}]
        >>> oai_chat_partial(Partial(0, 0, 0, "", [8], [], 2, 3), model="m", cmpl_id="c",
        ...                  created=1)
        []
    """
    head = _envelope("chat.completion.chunk", model, cmpl_id, created)
    chunks = []
    if res.n_decoded == 1 if send_role is None else send_role:
        chunks.append(_chunk(res.index, {"role": "assistant", "content": None}, None, head))
    if res.content:
        chunks.append(_chunk(res.index, {"content": res.content}, None, head))
    if chunks and res.probs:
        chunks[-1]["choices"][0]["logprobs"] = {"content": probs_json(res.probs, post_sampling)}
    if chunks and res.timings is not None:
        chunks[-1]["timings"] = timings_json(res.timings)
    return chunks


def oai_chat_final_chunks(
    res: Final, *, model: str, cmpl_id: str, created: int, include_usage: bool = False,
    send_role: bool = False,
) -> list[dict]:
    r"""The last ``chat.completion.chunk`` objects (``to_json_oaicompat_chat_stream``,
    ``server-task.cpp:462-526``): the text not sent yet, a chunk with the ``finish_reason``
    and an empty delta, and with ``include_usage`` a chunk with ``choices: []`` and the
    ``usage``; ``timings`` go with the last one.

    Args:
        res: the final result (its ``content`` is the unsent text).
        model: the envelope's model name.
        cmpl_id: the envelope's id.
        created: the envelope's time.
        include_usage: ``stream_options.include_usage``.
        send_role: also open with the role delta (no partial chunk was sent before).

    Examples:
        >>> from reference.tools.server.results import Timings
        >>> fin = Final(0, 0, 0, "", [], "word", "\n", 3, 9, 0, 12, False, True, Timings())
        >>> chunks = oai_chat_final_chunks(fin, model="m", cmpl_id="c", created=1,
        ...                                include_usage=True)
        >>> [(c["choices"], "usage" in c) for c in chunks]
        [([{'finish_reason': 'stop', 'index': 0, 'delta': {}}], False), ([], True)]
    """
    head = _envelope("chat.completion.chunk", model, cmpl_id, created)
    chunks = []
    if send_role:
        chunks.append(_chunk(res.index, {"role": "assistant", "content": None}, None, head))
    if res.content:
        chunks.append(_chunk(res.index, {"content": res.content}, None, head))
    chunks.append(_chunk(res.index, {}, finish_reason(res.stop_type), head))
    if include_usage:
        chunks.append({"choices": [], **head, "usage": usage(res)})
    chunks[-1]["timings"] = timings_json(res.timings)
    return chunks
# --8<-- [end:oai_chat]


def usage_chunk(obj: str, *, model: str, cmpl_id: str, created: int, usage: dict,
                timings: Timings) -> dict:
    """The last chunk of an OpenAI stream with ``stream_options.include_usage``:
    ``choices: []``, the ``usage`` and, as llama.cpp sends them, the ``timings``
    (``server-task.cpp``, ``to_json_oaicompat_chat_stream``).

    Examples:
        >>> c = usage_chunk("text_completion", model="m", cmpl_id="c", created=1,
        ...                 usage={"total_tokens": 3}, timings=Timings(predicted_n=2))
        >>> c["choices"], c["usage"], c["timings"]["predicted_n"]
        ([], {'total_tokens': 3}, 2)
    """
    return {"choices": [], **_envelope(obj, model, cmpl_id, created), "usage": usage,
            "timings": timings_json(timings)}


# ---------------------------------------------------------------------------------------------
# several results of one request
# ---------------------------------------------------------------------------------------------

def merge_results(objs: list[dict], oai: bool) -> dict | list[dict]:
    """The answer to a request with several results, in task order
    (``server-context.cpp:4336-4352``): one result is itself; native ones become an array;
    OpenAI ones become the first object with every result's choice in ``choices`` (its
    ``usage`` is the first result's, as in llama.cpp).

    Examples:
        >>> a = {"choices": [{"index": 0}], "usage": 1}
        >>> b = {"choices": [{"index": 1}], "usage": 2}
        >>> merge_results([a, b], oai=True)
        {'choices': [{'index': 0}, {'index': 1}], 'usage': 1}
        >>> merge_results([{"content": "x"}, {"content": "y"}], oai=False)
        [{'content': 'x'}, {'content': 'y'}]
    """
    if len(objs) == 1:
        return objs[0]
    if not oai:
        return list(objs)
    merged = dict(objs[0])
    merged["choices"] = [o["choices"][0] for o in objs]
    return merged
