r"""Request bodies to typed parameters: llama.cpp's server schema, field by field.

llama.cpp reads a completion request with a table of fields
(``tools/server/server-schema.cpp:11-517``, ``make_llama_cmpl_schema``): each field has a
name, aliases tried in order when the name is absent (``n_predict``, then
``max_completion_tokens``, then ``max_tokens``), a type and limits. A **soft** limit clamps
(``top_k: -5`` becomes 0, ``mirostat: 7`` becomes 2); a **hard** limit throws, and every error
is re-thrown as ``"Field '<name>': <what>"`` (``server-schema.cpp:577-583``), which the HTTP
layer sends as a 400 ``invalid_request_error``. A ``null`` value means "use the default"
(``has_value``, ``server-schema.cpp:585-588``); unknown fields are ignored, so that clients
may send every OpenAI field.

Where this module is stricter than llama.cpp, it says so:

- **types**: nlohmann's ``get<int>`` truncates ``2.7`` to 2 and reads ``true`` as 1; here a
  number field takes a JSON number (an integer field an integral one), a flag takes a boolean,
  and anything else is an error naming the field;
- **features we cannot honour** that change the output (``grammar``, ``json_schema``,
  ``response_format`` with a JSON type, ``tools``, ``suffix``, ``echo``, ``best_of`` other
  than 1, the ``infill``/``adaptive_p`` samplers) are errors, never silently ignored (llama.cpp
  refuses ``best_of``/``suffix``/``echo`` too: ``server-common.cpp:1050-1061``);
- ``repeat_penalty`` must be positive (the sampler divides by it).

The OpenAI endpoints first rewrite their body (``oaicompat_completion_params_parse``,
``oaicompat_chat_params_parse``, ``server-common.cpp:1036-1450``): for chat, ``logprobs`` is a
boolean and ``top_logprobs`` the number of candidates (default 20); for ``/v1/completions``,
``logprobs`` is that number. ``parse_completion(..., oai_chat=True)`` reads the chat form.

Prompts are tokenized as ``tokenize_input_prompts`` (``server-common.cpp:860-1029``): a string,
a token array, a mixed array of strings and ids, or a list of those (one task each).
"""

from __future__ import annotations

import copy
import json
import math
import re
from dataclasses import dataclass
from typing import Any

from llamaref.server.errors import BodyTooLarge
from reference.tokenizer import TokenizerError
from reference.tools.server.errors import ExceedContextSize as ExceedContextSize  # for the app
from reference.tools.server.errors import InvalidRequest
from reference.tools.server.params import SlotParams

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
FLT_MIN = 1.1754943508222875e-38  # the smallest normal float32
FLT_MAX = 3.4028234663852886e38

# --8<-- [start:LIMITS]
#: the most one request may ask for, so that no request allocates or computes without bound
#: (llama.cpp has no such limits, except ``n_probs``, which it clamps to the vocabulary)
MAX_N_PROBS = 100  # candidates reported per token (n_probs, logprobs, top_logprobs)
MAX_LOGIT_BIAS = 1024  # entries of logit_bias
MAX_BIAS_TEXT = 256  # characters of one text key of logit_bias
MAX_STOP = 16  # stop strings
MAX_STOP_LENGTH = 256  # characters of one stop string
MAX_BREAKERS = 16  # dry_sequence_breakers
MAX_SAMPLERS = 32  # entries of samplers
# --8<-- [end:LIMITS]


# ---------------------------------------------------------------------------------------------
# the body
# ---------------------------------------------------------------------------------------------

# --8<-- [start:parse_json]
def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


def parse_json(raw: bytes, limit: int) -> dict:
    """A request body as a JSON object (``json::parse(req.body)``).

    Args:
        raw: the body's bytes.
        limit: the most bytes accepted (``--body-limit``).

    Returns:
        The object.

    Raises:
        BodyTooLarge: more than ``limit`` bytes (HTTP 413).
        InvalidRequest: not UTF-8, not JSON (``NaN`` and ``Infinity`` included: JSON has
            neither), or not an object.

    Examples:
        >>> parse_json(b'{"prompt": "Hi"}', 1024)
        {'prompt': 'Hi'}
        >>> parse_json(b'[1]', 1024)
        Traceback (most recent call last):
        ...
        reference.tools.server.errors.InvalidRequest: Invalid JSON: the body must be a JSON object
        >>> from llamaref.server.errors import http_status
        >>> try:
        ...     parse_json(b'{}' + b' ' * 2000, 1024)
        ... except BodyTooLarge as e:
        ...     print(http_status(e), e)
        413 request body of 2002 bytes exceeds the limit of 1024 bytes (--body-limit)
    """
    if len(raw) > limit:
        raise BodyTooLarge(
            f"request body of {len(raw)} bytes exceeds the limit of {limit} bytes (--body-limit)"
        )
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise InvalidRequest(f"Invalid JSON: {e}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("Invalid JSON: the body must be a JSON object")
    return body
# --8<-- [end:parse_json]


# ---------------------------------------------------------------------------------------------
# values: one type check per JSON type, every error naming its field
# ---------------------------------------------------------------------------------------------

def _type_name(value: Any) -> str:
    """The JSON type of a Python value, as an error message says it."""
    names = {bool: "boolean", int: "number", float: "number", str: "string", list: "array",
             dict: "object", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _as_bool(name: str, value: Any) -> bool:
    """A JSON boolean (``get<bool>``)."""
    if not isinstance(value, bool):
        raise InvalidRequest(f"Field '{name}': must be a boolean, got {_type_name(value)}")
    return value


def _as_int(name: str, value: Any) -> int:
    """A JSON integer; an integral float (``5.0``) is read as that integer."""
    if isinstance(value, float) and math.isfinite(value) and value == int(value):
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"Field '{name}': must be an integer, got {_type_name(value)} "
                             f"{json.dumps(value)[:40]}")
    return value


def _as_float(name: str, value: Any) -> float:
    """A finite JSON number (``get<float>``)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequest(f"Field '{name}': must be a number, got {_type_name(value)}")
    if not math.isfinite(value):
        raise InvalidRequest(f"Field '{name}': must be a finite number, got {value}")
    return float(value)


def _as_str(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise InvalidRequest(f"Field '{name}': must be a string, got {_type_name(value)}")
    return value


def _as_list(name: str, value: Any) -> list:
    if not isinstance(value, list):
        raise InvalidRequest(f"Field '{name}': must be an array, got {_type_name(value)}")
    return value


def _lookup(body: dict, names: tuple[str, ...]) -> tuple[str, Any] | None:
    """The first of ``names`` with a non-null value, and that value (alias order)."""
    for name in names:
        if body.get(name) is not None:
            return name, body[name]
    return None


def _at_most(name: str, n: int, limit: int, what: str) -> None:
    """A size limit of the server (no request allocates without bound).

    Raises:
        InvalidRequest: ``n > limit``, naming the field and the limit.
    """
    if n > limit:
        raise InvalidRequest(f"Field '{name}': at most {limit} {what} are accepted, got {n}")


# ---------------------------------------------------------------------------------------------
# the numeric fields: make_llama_cmpl_schema's table
# ---------------------------------------------------------------------------------------------

# --8<-- [start:NumField]
@dataclass(frozen=True)
class NumField:
    """One numeric field of ``make_llama_cmpl_schema`` (``field_num``).

    Attributes:
        names: the field's name, then its aliases, in the order they are tried.
        attr: where it goes: ``"n_predict"`` (a [`SlotParams`][] attribute) or
            ``"sampling.top_k"`` (a ``SamplerParams`` one).
        integer: an integer field (else a float one).
        lo, hi: the inclusive limits.
        hard: out of limits is an error (``set_hard_limits``); otherwise it is clamped
            (``set_limits``).
    """

    names: tuple[str, ...]
    attr: str
    integer: bool
    lo: float = -math.inf
    hi: float = math.inf
    hard: bool = False


def completion_fields(n_parallel: int) -> list[NumField]:
    """The numeric fields of a completion request, with llama.cpp's names, aliases and
    limits (``server-schema.cpp:44-185``).

    Examples:
        >>> f = completion_fields(4)[0]
        >>> f.names, f.lo, f.hi, f.hard
        (('n_predict', 'max_completion_tokens', 'max_tokens'), -1, 2147483647, True)
    """
    def i(names, attr, lo=-math.inf, hi=math.inf, hard=False):
        return NumField(names, attr, True, lo, hi, hard)

    def f(names, attr, lo=-math.inf, hi=math.inf):
        return NumField(names, attr, False, lo, hi, False)

    return [
        i(("n_predict", "max_completion_tokens", "max_tokens"), "n_predict", -1, INT32_MAX, True),
        i(("n_keep",), "n_keep", -1, INT32_MAX, True),
        i(("n_discard",), "n_discard", 0, INT32_MAX, True),
        i(("n_cmpl", "n"), "n_cmpl", 1, n_parallel, True),
        i(("n_cache_reuse",), "n_cache_reuse", 0, INT32_MAX, True),
        i(("t_max_predict_ms",), "t_max_predict_ms", -1, INT64_MAX, True),
        i(("top_k",), "sampling.top_k", 0, INT32_MAX),
        f(("top_p",), "sampling.top_p", 0.0, 1.0),
        f(("min_p",), "sampling.min_p", 0.0, 1.0),
        f(("top_n_sigma",), "sampling.top_n_sigma"),
        f(("xtc_probability",), "sampling.xtc_probability", 0.0, 1.0),
        f(("xtc_threshold",), "sampling.xtc_threshold", 0.0, 1.0),
        f(("typical_p",), "sampling.typ_p"),
        f(("temperature",), "sampling.temp", 0.0, math.inf),
        f(("dynatemp_range",), "sampling.dynatemp_range"),
        f(("dynatemp_exponent",), "sampling.dynatemp_exponent"),
        i(("repeat_last_n",), "sampling.penalty_last_n", 0, INT32_MAX, True),
        f(("repeat_penalty",), "sampling.penalty_repeat"),
        f(("frequency_penalty",), "sampling.penalty_freq"),
        f(("presence_penalty",), "sampling.penalty_present"),
        f(("dry_multiplier",), "sampling.dry_multiplier"),
        i(("dry_allowed_length",), "sampling.dry_allowed_length", 0, INT32_MAX, True),
        i(("dry_penalty_last_n",), "sampling.dry_penalty_last_n", 0, INT32_MAX, True),
        i(("mirostat",), "sampling.mirostat", 0, 2),
        f(("mirostat_tau",), "sampling.mirostat_tau"),
        f(("mirostat_eta",), "sampling.mirostat_eta"),
        i(("min_keep",), "sampling.min_keep", 0, INT32_MAX, True),
    ]
# --8<-- [end:NumField]


def _set(params: SlotParams, attr: str, value: Any) -> None:
    """``params.<attr> = value`` for ``"n_keep"`` or ``"sampling.top_k"``."""
    target = params
    *path, last = attr.split(".")
    for part in path:
        target = getattr(target, part)
    setattr(target, last, value)


def eval_num(field: NumField, body: dict, params: SlotParams) -> None:
    """``field_num::eval`` (``server-schema.cpp:590-610``): read the first present name,
    clamp to soft limits or refuse values outside hard ones, store it.

    Raises:
        InvalidRequest: a wrong type, or a value outside hard limits.

    Examples:
        >>> p = SlotParams()
        >>> eval_num(NumField(("top_k",), "sampling.top_k", True, 0, 100), {"top_k": -5}, p)
        >>> p.sampling.top_k
        0
        >>> eval_num(NumField(("n_keep",), "n_keep", True, -1, 10, True), {"n_keep": 11}, p)
        Traceback (most recent call last):
        ...
        reference.tools.server.errors.InvalidRequest: Field 'n_keep': value must be between \
-1 <= value <= 10, but got 11
    """
    found = _lookup(body, field.names)
    if found is None:
        return
    name, raw = found
    value = _as_int(name, raw) if field.integer else _as_float(name, raw)
    if field.hard and not field.lo <= value <= field.hi:
        raise InvalidRequest(f"Field '{name}': value must be between {field.lo} <= value <= "
                             f"{field.hi}, but got {value}")
    value = min(max(value, field.lo), field.hi)
    _set(params, field.attr, int(value) if field.integer else float(value))


# ---------------------------------------------------------------------------------------------
# the fields with their own handlers
# ---------------------------------------------------------------------------------------------

#: the boolean fields (``field_bool``) and their SlotParams attributes
BOOL_FIELDS = {"timings_per_token": "timings_per_token", "stream": "stream",
               "cache_prompt": "cache_prompt", "return_tokens": "return_tokens",
               "post_sampling_probs": "post_sampling_probs"}

#: llama.cpp's sampler names and aliases (``common_sampler_types_from_names``,
#: ``common/sampling.cpp:833-893``) to ours
SAMPLER_NAMES = {
    "dry": "dry", "top_k": "top_k", "top_p": "top_p", "top_n_sigma": "top_n_sigma",
    "typ_p": "typ_p", "min_p": "min_p", "temperature": "temperature", "xtc": "xtc",
    "penalties": "penalties", "infill": "infill", "adaptive_p": "adaptive_p",
    "top-k": "top_k", "topk": "top_k", "top-p": "top_p", "topp": "top_p",
    "top-n-sigma": "top_n_sigma", "topnsigma": "top_n_sigma", "typ-p": "typ_p",
    "typp": "typ_p", "min-p": "min_p", "minp": "min_p", "adaptive-p": "adaptive_p",
    "adaptivep": "adaptive_p", "nucleus": "top_p", "temp": "temperature", "typ": "typ_p",
}

#: one character per sampler (``common_sampler_type_to_chr``, ``common/sampling.cpp:799``)
SAMPLER_CHARS = {"d": "dry", "k": "top_k", "y": "typ_p", "p": "top_p", "s": "top_n_sigma",
                 "m": "min_p", "t": "temperature", "x": "xtc", "i": "infill",
                 "e": "penalties", "a": "adaptive_p"}

#: samplers llama.cpp knows and the reference chain does not have
UNSUPPORTED_SAMPLERS = ("infill", "adaptive_p")


def parse_samplers(value: Any) -> list[str]:
    """``samplers``: an array of names (aliases, any case) or a string of sampler chars;
    unknown names are skipped, as llama.cpp does (``server-schema.cpp:505-514``).

    Raises:
        InvalidRequest: not an array of strings nor a string, or a sampler the reference
            chain does not implement (``infill``, ``adaptive_p``).

    Examples:
        >>> parse_samplers(["Top-K", "temp", "bogus"]), parse_samplers("kpt")
        (['top_k', 'temperature'], ['top_k', 'top_p', 'temperature'])
    """
    if isinstance(value, str):
        _at_most("samplers", len(value), MAX_SAMPLERS, "characters")
        names = [SAMPLER_CHARS[c] for c in value if c in SAMPLER_CHARS]
    else:
        items = _as_list("samplers", value)
        _at_most("samplers", len(items), MAX_SAMPLERS, "entries")
        if not all(isinstance(s, str) for s in items):
            raise InvalidRequest("Field 'samplers': must be an array of strings or a string")
        names = [SAMPLER_NAMES[s.lower()] for s in items if s.lower() in SAMPLER_NAMES]
    bad = [s for s in names if s in UNSUPPORTED_SAMPLERS]
    if bad:
        raise InvalidRequest(f"Field 'samplers': sampler '{bad[0]}' is not supported")
    return names


def parse_stop(value: Any, default: list[str]) -> list[str]:
    r"""``stop``: a string or an array of strings; empty strings are dropped, and no stop
    string at all falls back to the server's (``server-schema.cpp:487-503``).

    Examples:
        >>> parse_stop("\n", []), parse_stop(["a", ""], []), parse_stop([], ["</s>"])
        (['\n'], ['a'], ['</s>'])
    """
    if isinstance(value, str):
        words = [value] if value else []
    else:
        items = _as_list("stop", value)
        if not all(isinstance(w, str) for w in items):
            raise InvalidRequest("Field 'stop': must be a string or an array of strings")
        words = [w for w in items if w]
    _at_most("stop", len(words), MAX_STOP, "strings")
    for w in words:
        _at_most("stop", len(w), MAX_STOP_LENGTH, "characters per string")
    return words or list(default)


def _bias_value(value: Any) -> float | None:
    """A bias: a number, or ``false`` for ``-inf``; anything else is skipped (None)."""
    if value is False:
        return -math.inf
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if math.isnan(value):
        raise InvalidRequest("Field 'logit_bias': a bias must not be NaN")
    return float(value)


_STRTOL = re.compile(r"[ \t\n\v\f\r]*[+-]?[0-9]*")


def bias_key(key: str) -> int | str:
    r"""An object key of ``logit_bias`` as llama.cpp reads it: ``strtol(key, &end, 10)``
    that stops at the key's end is a token id (C's whitespace and sign allowed, ASCII digits
    only, and an empty key is 0), anything else is text to tokenize.

    Examples:
        >>> bias_key("42"), bias_key(" -5"), bias_key("+7"), bias_key("")
        (42, -5, 7, 0)
        >>> bias_key("²"), bias_key("--5"), bias_key("5a"), bias_key("+"), bias_key("Hello")
        ('²', '--5', '5a', '+', 'Hello')
    """
    if key == "":
        return 0  # no digits: strtol's end is the key's start, here its terminating NUL
    if not _STRTOL.fullmatch(key) or not key.strip(" \t\n\v\f\r").lstrip("+-"):
        return key
    return int(key.strip(" \t\n\v\f\r"))


def _bias_tokens(key: Any, tokenizer: Any, n_vocab: int) -> list[int]:
    """The tokens a bias key names: an id in range (others are ignored), or every token of
    a string (tokenized without BOS, specials not parsed)."""
    if isinstance(key, bool):
        return []
    if isinstance(key, int):
        return [key] if 0 <= key < n_vocab else []
    if isinstance(key, str):
        _at_most("logit_bias", len(key), MAX_BIAS_TEXT, "characters per text key")
        return tokenizer.tokenize(key, add_special=False, parse_special=False)
    return []


def parse_logit_bias(value: Any, tokenizer: Any, n_vocab: int) -> dict[int, float]:
    """``logit_bias`` (``server-schema.cpp:434-473``): an array of ``[token, bias]`` pairs or
    an object ``{"token id or text": bias}``. A bias is a number, or ``false`` for ``-inf``
    (the token is banned); a text key biases each of its tokens; ids outside the vocabulary
    and malformed entries are skipped, as llama.cpp does. llama.cpp keeps a list and adds
    every entry to the logit, so repeated tokens here add up.

    Raises:
        InvalidRequest: ``logit_bias`` is neither an array nor an object, a bias is NaN, or
            more than `MAX_LOGIT_BIAS` entries or a text key over
            `MAX_BIAS_TEXT` characters.

    Examples:
        >>> parse_logit_bias([[5, 1.5], [5, 1.0], [10**9, 3], ["x"]], None, 100)
        {5: 2.5}
        >>> parse_logit_bias({"7": False, "bad": "x", "-3": 1}, None, 100)
        {7: -inf}
    """
    if isinstance(value, list):
        pairs = [(e[0], e[1]) for e in value if isinstance(e, list) and len(e) == 2]
    elif isinstance(value, dict):
        pairs = [(bias_key(k), v) for k, v in value.items()]
    else:
        raise InvalidRequest(f"Field 'logit_bias': must be an array of [token, bias] pairs or "
                             f"an object, got {_type_name(value)}")
    _at_most("logit_bias", len(value), MAX_LOGIT_BIAS, "entries")
    out: dict[int, float] = {}
    for key, raw in pairs:
        bias = _bias_value(raw)
        if bias is None:
            continue
        for tok in _bias_tokens(key, tokenizer, n_vocab):
            out[tok] = out.get(tok, 0.0) + bias
    return out


def parse_breakers(value: Any) -> list[str]:
    r"""``dry_sequence_breakers``: a non-empty array of strings (``server-schema.cpp:242-249``).

    Examples:
        >>> parse_breakers(["\n", "."])
        ['\n', '.']
    """
    if not (isinstance(value, list) and value and all(isinstance(s, str) for s in value)):
        raise InvalidRequest("Field 'dry_sequence_breakers': must be a non-empty array of "
                             "strings")
    _at_most("dry_sequence_breakers", len(value), MAX_BREAKERS, "strings")
    return list(value)


# ---------------------------------------------------------------------------------------------
# what we refuse
# ---------------------------------------------------------------------------------------------

def check_unsupported(body: dict) -> None:
    """Refuse the OpenAI and llama.cpp fields that would change the output and that this
    server cannot honour (null and neutral values pass).

    Raises:
        InvalidRequest: naming the field.

    Examples:
        >>> check_unsupported({"response_format": {"type": "text"}, "best_of": 1, "echo": False})
        >>> check_unsupported({"grammar": "root ::= [a-z]+"})
        Traceback (most recent call last):
        ...
        reference.tools.server.errors.InvalidRequest: Field 'grammar': constrained generation \
(grammars, JSON schemas) is not supported
    """
    def refuse(name: str, what: str) -> None:
        raise InvalidRequest(f"Field '{name}': {what} is not supported")

    for name in ("grammar", "json_schema"):
        if body.get(name) not in (None, ""):
            refuse(name, "constrained generation (grammars, JSON schemas)")
    fmt = body.get("response_format")
    if fmt is not None:
        if not isinstance(fmt, dict):
            raise InvalidRequest(f"Field 'response_format': must be an object, got "
                                 f"{_type_name(fmt)}")
        kind = fmt.get("type")
        if kind not in (None, "text"):
            refuse("response_format", f"response_format type {json.dumps(kind)}")
    if body.get("tools") not in (None, []):
        refuse("tools", "tool calling")
    if body.get("tool_choice") not in (None, "auto", "none"):
        refuse("tool_choice", "tool calling")
    if body.get("suffix") is not None:
        refuse("suffix", "suffix (fill-in-the-middle)")
    if body.get("echo") not in (None, False):
        refuse("echo", "echoing the prompt")
    if body.get("best_of") not in (None, 1):
        refuse("best_of", "best_of other than 1")


# ---------------------------------------------------------------------------------------------
# a completion request
# ---------------------------------------------------------------------------------------------

def _eval_bools(body: dict, params: SlotParams) -> None:
    for name, attr in BOOL_FIELDS.items():
        if body.get(name) is not None:
            setattr(params, attr, _as_bool(name, body[name]))
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise InvalidRequest(f"Field 'stream_options': must be an object, got "
                                 f"{_type_name(options)}")
        if options.get("include_usage") is not None:
            params.include_usage = _as_bool("include_usage", options["include_usage"])


def _eval_n_probs(body: dict, params: SlotParams, oai_chat: bool) -> None:
    """``n_probs`` (alias ``logprobs``), or for chat ``logprobs: true`` with
    ``top_logprobs`` (default 20; ``server-common.cpp:1429-1438``). At most
    [`MAX_N_PROBS`][] (llama.cpp clamps to the vocabulary; a larger value is a 400 here)."""
    names = ("n_probs",) if oai_chat else ("n_probs", "logprobs")
    eval_num(NumField(names, "n_probs", True, 0, INT32_MAX), body, params)
    found = _lookup(body, names)
    if found is not None and params.n_probs > MAX_N_PROBS:
        name = found[0]
        raise InvalidRequest(f"Field '{name}': value must be between 0 <= value <= "
                             f"{MAX_N_PROBS} (the server's limit), but got {params.n_probs}")
    if not oai_chat:
        return
    top = body.get("top_logprobs")
    if body.get("logprobs") is not None and _as_bool("logprobs", body["logprobs"]):
        n = 20 if top is None else _as_int("top_logprobs", top)
        if not 0 <= n <= 20:
            raise InvalidRequest(f"Field 'top_logprobs': value must be between 0 <= value "
                                 f"<= 20, but got {n}")
        params.n_probs = n
    elif top is not None:
        raise InvalidRequest("Field 'top_logprobs': requires logprobs to be set to true")


def _eval_sampling_extras(body: dict, params: SlotParams, defaults: SlotParams) -> None:
    """The sampling fields with handlers: seed, dry_base, breakers, samplers, penalty."""
    s = params.sampling
    if body.get("seed") is not None:
        s.seed = _as_int("seed", body["seed"]) & 0xFFFFFFFF  # uint32_t: -1 is 0xFFFFFFFF
    if body.get("dry_base") is not None:
        v = _as_float("dry_base", body["dry_base"])
        s.dry_base = defaults.sampling.dry_base if v < 1.0 else v
    if body.get("dry_sequence_breakers") is not None:
        s.dry_sequence_breakers = parse_breakers(body["dry_sequence_breakers"])
    if body.get("samplers") is not None:
        s.samplers = parse_samplers(body["samplers"])
    if not FLT_MIN <= s.penalty_repeat <= FLT_MAX:
        raise InvalidRequest(f"Field 'repeat_penalty': value must be between {FLT_MIN:.8g} "
                             f"<= value <= {FLT_MAX:.8g} (a float32 whose reciprocal is "
                             f"finite; the sampler divides by it), but got {s.penalty_repeat}")


def _eval_id_slot(body: dict, params: SlotParams, n_parallel: int) -> None:
    """``id_slot``: -1 (any) or a slot; llama.cpp wraps larger ids around
    (``get_slot_by_id``, ``server-context.cpp:1501-1512``)."""
    if body.get("id_slot") is None:
        return
    v = _as_int("id_slot", body["id_slot"])
    if v < -1:
        raise InvalidRequest(f"Field 'id_slot': must be -1 or a slot id, got {v}")
    params.id_slot = v if v == -1 else v % n_parallel


# --8<-- [start:parse_completion]
def parse_completion(
    body: dict, defaults: SlotParams, n_parallel: int, n_vocab: int, tokenizer: Any,
    oai_chat: bool = False,
) -> SlotParams:
    r"""A completion request's parameters (``eval_llama_cmpl_schema``,
    ``server-schema.cpp:519-571``): the server's defaults, overridden field by field.

    Args:
        body: the request object.
        defaults: the server's parameters (``--n-predict``, ``--temp``, ...); not modified.
        n_parallel: the number of slots (``n`` may not exceed it).
        n_vocab: the vocabulary size (``logit_bias`` ids outside it are ignored).
        tokenizer: tokenizes ``logit_bias`` texts; its ``eog_ids`` get ``-inf`` with
            ``ignore_eos``.
        oai_chat: the body is a chat request (``logprobs`` is a boolean, ``top_logprobs``
            the count).

    Returns:
        A new [`SlotParams`][].

    Raises:
        InvalidRequest: a wrong type, a value outside a hard limit or an unsupported feature;
            the message names the field.

    Examples:
        >>> p = parse_completion({"max_tokens": 8, "temperature": -1, "seed": -1, "n": 2,
        ...                       "stop": "\n"}, SlotParams(), 4, 100, None)
        >>> p.n_predict, p.sampling.temp, p.sampling.seed == 0xFFFFFFFF, p.n_cmpl, p.stop
        (8, 0.0, True, 2, ['\n'])
        >>> try:
        ...     parse_completion({"top_k": "40"}, SlotParams(), 4, 100, None)
        ... except InvalidRequest as e:
        ...     print(e)
        Field 'top_k': must be an integer, got string "40"
    """
    check_unsupported(body)
    params = copy.deepcopy(defaults)
    _eval_bools(body, params)
    for field in completion_fields(n_parallel):
        eval_num(field, body, params)
    _eval_n_probs(body, params, oai_chat)
    _eval_sampling_extras(body, params, defaults)
    _eval_id_slot(body, params, n_parallel)
    if body.get("stop") is not None:
        params.stop = parse_stop(body["stop"], defaults.stop)
    if body.get("logit_bias") is not None:
        params.sampling.logit_bias = parse_logit_bias(body["logit_bias"], tokenizer, n_vocab)
    if body.get("ignore_eos") is not None:
        params.ignore_eos = _as_bool("ignore_eos", body["ignore_eos"])
        if params.ignore_eos:  # every end-of-generation token gets -inf (server-schema.cpp:475)
            for tok in sorted(tokenizer.eog_ids):
                params.sampling.logit_bias[tok] = -math.inf
    return params
# --8<-- [end:parse_completion]


# ---------------------------------------------------------------------------------------------
# prompts
# ---------------------------------------------------------------------------------------------

def _is_token(x: Any) -> bool:
    """A JSON integer (``is_number_integer``; booleans are not)."""
    return isinstance(x, int) and not isinstance(x, bool)


def tokenize_mixed(prompt: Any, tokenizer: Any, add_special: bool, parse_special: bool) -> list:
    """``tokenize_mixed`` (``server-common.cpp:867-899``): a string, or an array of strings
    and token ids; only a leading string gets BOS.

    Examples:
        >>> from reference.model_loader import default_model_path
        >>> from reference.tokenizer import Tokenizer
        >>> tok = Tokenizer.from_gguf(default_model_path())
        >>> tokenize_mixed([1, " world"], tok, True, True)
        [1, 905]
    """
    if isinstance(prompt, str):
        return tokenizer.tokenize(prompt, add_special=add_special, parse_special=parse_special)
    tokens: list[int] = []
    for i, p in enumerate(prompt):
        if isinstance(p, str):
            tokens += tokenizer.tokenize(p, add_special=add_special and i == 0,
                                         parse_special=parse_special)
        elif _is_token(p):
            tokens.append(p)
        else:
            raise InvalidRequest(f"Field 'prompt': elements must be strings or token ids, "
                                 f"got {_type_name(p)}")
    return tokens


def _subprompt(p: Any, tokenizer: Any) -> list[int]:
    """``tokenize_input_subprompt`` (``server-common.cpp:965-1006``) for one task."""
    if isinstance(p, str) or (isinstance(p, list) and all(
            isinstance(x, str) or _is_token(x) for x in p)):
        return tokenize_mixed(p, tokenizer, add_special=True, parse_special=True)
    if isinstance(p, dict) and "prompt_string" in p:
        if "multimodal_data" in p:
            raise InvalidRequest("Field 'prompt': multimodal data is not supported")
        text = p["prompt_string"]
        if not isinstance(text, str | list):
            raise InvalidRequest(f"Field 'prompt': 'prompt_string' must be a string or an "
                                 f"array of strings and token ids, got {_type_name(text)}")
        return tokenize_mixed(text, tokenizer, True, True)
    raise InvalidRequest("Field 'prompt': elements must be a string, a list of tokens, a JSON "
                         "object containing a prompt string, or a list of mixed strings & "
                         "tokens")


def _check_ids(tokens: list[int], n_vocab: int) -> list[int]:
    """``server_tokens::validate``: every id in ``[0, n_vocab)``."""
    for t in tokens:
        if not 0 <= t < n_vocab:
            raise InvalidRequest(f"Field 'prompt': token id {t} out of range [0, {n_vocab})")
    return tokens


# --8<-- [start:parse_prompt]
def parse_prompt(prompt: Any, tokenizer: Any, n_vocab: int | None = None) -> list[list[int]]:
    """``tokenize_input_prompts`` (``server-common.cpp:1009-1029``) with BOS added and
    special tokens parsed: one token list per task.

    An array holding any integer is *one* prompt (tokens, or strings and tokens mixed); any
    other array is a list of prompts.

    Args:
        prompt: the ``prompt`` value of the request.
        tokenizer: the model's tokenizer.
        n_vocab: the bound of the ids (default: the tokenizer's).

    Returns:
        The prompts' tokens (a prompt may be empty: the scheduler answers it with no text).

    Raises:
        InvalidRequest: no prompt, an empty list of prompts, a malformed element or a token id
            outside the vocabulary.

    Examples:
        >>> from reference.model_loader import default_model_path
        >>> from reference.tokenizer import Tokenizer
        >>> tok = Tokenizer.from_gguf(default_model_path())
        >>> parse_prompt("Hello world", tok), parse_prompt([19556, 905], tok)
        ([[19556, 905]], [[19556, 905]])
        >>> parse_prompt(["Hello", [905]], tok)
        [[19556], [905]]
    """
    if prompt is None:
        raise InvalidRequest("Field 'prompt': required")
    if isinstance(prompt, list) and not any(_is_token(x) for x in prompt):
        prompts = [_subprompt(p, tokenizer) for p in prompt]
    else:
        prompts = [_subprompt(prompt, tokenizer)]
    if not prompts:
        raise InvalidRequest("Field 'prompt': must not be empty")
    n_vocab = tokenizer.n_vocab if n_vocab is None else n_vocab
    return [_check_ids(p, n_vocab) for p in prompts]
# --8<-- [end:parse_prompt]


# ---------------------------------------------------------------------------------------------
# chat messages
# ---------------------------------------------------------------------------------------------

CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
MEDIA_PARTS = ("image_url", "input_image", "input_audio", "input_video", "video_url", "file")


def _content_text(i: int, content: list) -> str:
    """Text parts joined with newlines (``concat_content_parts``, ``common/chat.cpp:511``)."""
    text = ""
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in MEDIA_PARTS:
            raise InvalidRequest(f"Field 'messages': message {i}: content type '{kind}' is not "
                                 f"supported (this server reads text only)")
        if kind != "text" or not isinstance(part.get("text"), str):
            raise InvalidRequest(f"Field 'messages': message {i}: content parts must be "
                                 f'{{"type": "text", "text": string}}')
        text += ("\n" if text else "") + part["text"]
    return text


def _message(i: int, msg: Any) -> dict:
    """One message checked, with its content as one string."""
    if not isinstance(msg, dict):
        raise InvalidRequest(f"Field 'messages': message {i} must be an object")
    role = msg.get("role")
    if role not in CHAT_ROLES:
        raise InvalidRequest(f"Field 'messages': message {i}: role must be one of "
                             f"{', '.join(CHAT_ROLES)}, got {json.dumps(role)[:40]}")
    if "content" not in msg:
        raise InvalidRequest(f"Field 'messages': message {i}: 'content' is required")
    content = msg["content"]
    if content is None and role == "assistant":
        content = ""
    elif isinstance(content, list):
        content = _content_text(i, content)
    elif not isinstance(content, str):
        raise InvalidRequest(f"Field 'messages': message {i}: content must be a string or an "
                             f"array of text parts, got {_type_name(content)}")
    return {"role": role, "content": content}


# --8<-- [start:parse_chat]
def parse_chat(body: dict, tokenizer: Any) -> list[int]:
    r"""A chat request's prompt: ``messages`` checked (``oaicompat_chat_params_parse``,
    ``server-common.cpp:1286-1313``) and rendered by the model's chat template.

    **Assistant prefill**, as llama-server (``--prefill-assistant`` is its default): a final
    assistant message is *continued*: the prompt is the conversation before it with the
    generation prompt, then that message's text, and the model writes on from there.
    ``continue_final_message: true`` asks for the same for any final message (the template
    renders the conversation without a generation prompt and the prompt ends where the last
    message's text ends); ``add_generation_prompt: false`` renders without the assistant's
    header.

    Args:
        body: the request object.
        tokenizer: the model's tokenizer, with a chat template.

    Returns:
        The prompt tokens (BOS and the assistant's header included).

    Raises:
        InvalidRequest: ``messages`` missing, empty or malformed (a role outside
            system/user/assistant/tool/developer, content neither a string, null for an
            assistant, nor text parts; images and audio are not supported), two assistant
            messages at the end, ``add_generation_prompt`` and ``continue_final_message``
            both true (llama.cpp's messages), or the model has no chat template.

    Examples:
        >>> from reference.model_loader import default_model_path
        >>> from reference.tokenizer import Tokenizer
        >>> tok = Tokenizer.from_gguf(default_model_path())
        >>> ids = parse_chat({"messages": [{"role": "user", "content": [
        ...     {"type": "text", "text": "Hi"}]}]}, tok)
        >>> tok.detokenize(ids[-4:], unparse_special=True)
        '<|im_start|>assistant\n'
        >>> ids = parse_chat({"messages": [{"role": "user", "content": "Hi"},
        ...                                {"role": "assistant", "content": "Hello, I"}]}, tok)
        >>> tok.detokenize(ids, unparse_special=True).endswith("<|im_start|>assistant\nHello, I")
        True
    """
    messages = body.get("messages")
    if messages is None:
        raise InvalidRequest("Field 'messages': required")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("Field 'messages': must be a non-empty array of messages")
    clean = [_message(i, m) for i, m in enumerate(messages)]
    add_generation_prompt = _flag(body, "add_generation_prompt", True)
    continue_final = _flag(body, "continue_final_message", False)
    if not continue_final and clean[-1]["role"] == "assistant":
        if len(clean) >= 2 and clean[-2]["role"] == "assistant":
            raise InvalidRequest("Cannot have 2 or more assistant messages at the end of the "
                                 "list.")
        continue_final, add_generation_prompt = True, False
    if continue_final and add_generation_prompt:
        raise InvalidRequest("Cannot set both add_generation_prompt and "
                             "continue_final_message to true.")
    try:
        text = (_continued(clean, tokenizer) if continue_final
                else tokenizer.apply_chat_template(clean, add_generation_prompt))
    except TokenizerError as e:
        raise InvalidRequest(f"Field 'messages': {e}") from None
    return _chat_text_tokens(tokenizer, text)


def _continued(messages: list[dict], tokenizer: Any) -> str:
    """The rendered conversation ending inside its last message: for an assistant message
    llama.cpp's prefill (the rest rendered with the generation prompt, then the message's
    text); for another role the rendering cut after that message's text."""
    last = messages[-1]
    if last["role"] == "assistant":
        return tokenizer.apply_chat_template(messages[:-1], True) + last["content"]
    text = tokenizer.apply_chat_template(messages, False)
    at = text.rfind(last["content"])
    if at < 0:
        raise InvalidRequest("Field 'messages': the chat template changes the final message's "
                             "text, so it cannot be continued")
    return text[: at + len(last["content"])]


def _chat_text_tokens(tokenizer: Any, text: str) -> list[int]:
    """A rendered chat as tokens (BOS added, special tokens parsed; a template that writes
    its own BOS does not get a second one: ``chat_tokens``)."""
    tokens = tokenizer.tokenize(text, add_special=True, parse_special=True)
    bos = tokenizer.bos_id
    if len(tokens) >= 2 and tokens[0] == tokens[1] == bos:
        tokens = tokens[1:]
    return tokens
# --8<-- [end:parse_chat]


# ---------------------------------------------------------------------------------------------
# /tokenize, /detokenize
# ---------------------------------------------------------------------------------------------

def _flag(body: dict, name: str, default: bool) -> bool:
    return default if body.get(name) is None else _as_bool(name, body[name])


def _piece_json(piece: bytes) -> str | list[int]:
    """A piece as text if it is valid UTF-8, else its byte values (``is_valid_utf8``)."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return list(piece)


def parse_tokenize(body: dict, tokenizer: Any) -> dict:
    """``POST /tokenize`` (``server-context.cpp:5065-5104``): ``content`` (a string or a
    mixed array) with ``add_special`` (default false), ``parse_special`` (default true) and
    ``with_pieces``; the answer is ``{"tokens": [...]}``, ids or ``{"id", "piece"}`` objects
    (a piece that is not valid UTF-8 is given as its byte values).

    Raises:
        InvalidRequest: a flag that is not a boolean, or a malformed ``content``.

    Examples:
        >>> from reference.model_loader import default_model_path
        >>> from reference.tokenizer import Tokenizer
        >>> tok = Tokenizer.from_gguf(default_model_path())
        >>> parse_tokenize({"content": "Hello world"}, tok)
        {'tokens': [19556, 905]}
        >>> parse_tokenize({"content": "Hello", "with_pieces": True}, tok)
        {'tokens': [{'id': 19556, 'piece': 'Hello'}]}
    """
    add_special = _flag(body, "add_special", False)
    parse_special = _flag(body, "parse_special", True)
    with_pieces = _flag(body, "with_pieces", False)
    content = body.get("content")
    if content is None:
        return {"tokens": []}
    if not isinstance(content, str | list):
        raise InvalidRequest(f"Field 'content': must be a string or an array, got "
                             f"{_type_name(content)}")
    tokens = _check_ids(tokenize_mixed(content, tokenizer, add_special, parse_special),
                        tokenizer.n_vocab)
    if not with_pieces:
        return {"tokens": tokens}
    pieces = [_piece_json(tokenizer.token_to_piece(t, special=True)) for t in tokens]
    return {"tokens": [{"id": t, "piece": p} for t, p in zip(tokens, pieces, strict=True)]}


def parse_detokenize(body: dict, n_vocab: int) -> list[int]:
    """``POST /detokenize`` (``server-context.cpp:5106-5118``): the ``tokens`` to turn into
    text (none: an empty list). Answer with [`detokenize_response`][].

    Raises:
        InvalidRequest: ``tokens`` is not an array of ids in ``[0, n_vocab)``.

    Examples:
        >>> parse_detokenize({"tokens": [1, 2]}, 100), parse_detokenize({}, 100)
        ([1, 2], [])
    """
    tokens = body.get("tokens")
    if tokens is None:
        return []
    if not isinstance(tokens, list) or not all(_is_token(t) for t in tokens):
        raise InvalidRequest("Field 'tokens': must be an array of token ids")
    for t in tokens:
        if not 0 <= t < n_vocab:
            raise InvalidRequest(f"Field 'tokens': token id {t} out of range [0, {n_vocab})")
    return tokens


def detokenize_response(tokens: list[int], tokenizer: Any) -> dict:
    """The ``/detokenize`` answer: the pieces, special tokens rendered
    (``tokens_to_str``), invalid UTF-8 replaced.

    Examples:
        >>> from reference.model_loader import default_model_path
        >>> from reference.tokenizer import Tokenizer
        >>> tok = Tokenizer.from_gguf(default_model_path())
        >>> detokenize_response([1, 19556], tok)
        {'content': '<|im_start|>Hello'}
    """
    text = b"".join(tokenizer.token_to_piece(t, special=True) for t in tokens)
    return {"content": text.decode("utf-8", "replace")}


# ---------------------------------------------------------------------------------------------
# slot files
# ---------------------------------------------------------------------------------------------

#: code points ``fs_validate_filename`` refuses besides controls and surrogates
_FORBIDDEN = set(':*?"<>|/\\') | {"\uff0e", "\u2215", "\u2216", "\ufffd", "\ufeff"}


def _bad_char(c: str) -> bool:
    o = ord(c)
    return o <= 0x1F or o == 0x7F or 0x80 <= o <= 0x9F or 0xD800 <= o <= 0xDFFF or c in _FORBIDDEN


# --8<-- [start:validate_filename]
def validate_filename(name: Any) -> str:
    r"""``fs_validate_filename`` (``common/common.cpp:796-868``, no subdirectories): a slot
    file's name under ``--slot-save-path``.

    Refused: empty, over 255 bytes of UTF-8, not valid UTF-8 (lone surrogates), control
    characters (C0, DEL, C1), ``/ \ : * ? " < > |`` and their look-alikes (U+FF0E, U+2215,
    U+2216), U+FFFD, a BOM, a leading or trailing space, a trailing dot, any ``..``, and ``.``.

    Args:
        name: the ``filename`` of the request.

    Returns:
        The name.

    Raises:
        InvalidRequest: ``"Invalid filename"``.

    Examples:
        >>> validate_filename("slot1.bin")
        'slot1.bin'
        >>> validate_filename("../etc/passwd")
        Traceback (most recent call last):
        ...
        reference.tools.server.errors.InvalidRequest: Invalid filename
    """
    if not isinstance(name, str) or not name:
        raise InvalidRequest("Invalid filename")
    try:
        n_bytes = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidRequest("Invalid filename") from None
    if (n_bytes > 255 or any(_bad_char(c) for c in name) or name[0] == " "
            or name[-1] in " ." or ".." in name or name == "."):
        raise InvalidRequest("Invalid filename")
    return name
# --8<-- [end:validate_filename]

