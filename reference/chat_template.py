r"""Chat templates: messages to a prompt string, rendered as HF transformers renders them.

A chat model ships a Jinja template (GGUF ``tokenizer.chat_template``, or
``tokenizer_config.json``'s ``chat_template``) that turns a list of messages
(``{"role": "user", "content": "hi"}``) into the exact text the model was trained on, for
SmolLM2::

    <|im_start|>user
    hi<|im_end|>
    <|im_start|>assistant

transformers renders it (``render_jinja_template``) in a sandboxed Jinja environment with
``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` filter that
does not escape HTML, and the globals ``raise_exception``, ``strftime_now``, ``dict`` and
``namespace``; the variables are ``messages``, ``tools``, ``documents``,
``add_generation_prompt`` and the special tokens (``bos_token``, ``eos_token``, ...). We do the
same, so the same template gives the same string. (llama.cpp itself recognises well-known
templates and re-implements them in C++, ``llama_chat_apply_template``; that is not what we
follow.)

The rendered prompt is then tokenized with ``parse_special=True`` so that ``<|im_start|>``
becomes its control token, and ``add_special`` as the model asks
([`reference.tokenizer.Tokenizer.apply_chat_template`][reference.tokenizer.vocab.Tokenizer.apply_chat_template],
which reports a [`ChatTemplateError`][] as a ``TokenizerError``).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

from reference.common import LlamarefError


class ChatTemplateError(LlamarefError, ValueError):
    """A chat template that does not compile, refuses the messages, or fails to render."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"the chat template refused the messages: {message}")


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """transformers' ``tojson``: plain ``json.dumps``, no HTML escaping."""
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=32)
def _compile(template: str):
    """The compiled template, in transformers' environment."""
    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}``: transformers tracks it; we render it."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            call = self.call_method("_render", [])
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = dict
    env.globals["namespace"] = jinja2.utils.Namespace
    return env.from_string(template)


# --8<-- [start:render_chat_template]
def render_chat_template(
    template: str, messages: list[dict], add_generation_prompt: bool = True, **special_tokens: str
) -> str:
    r"""Render a chat template the way ``transformers``' ``apply_chat_template`` does.

    Args:
        template: the Jinja source.
        messages: dicts with at least ``role`` and ``content``.
        add_generation_prompt: end with the header of an assistant turn.
        **special_tokens: ``bos_token``, ``eos_token``, ... as the template expects them.

    Returns:
        The prompt text.

    Raises:
        ChatTemplateError: the template does not compile, refuses the messages
            (``raise_exception``), or fails while rendering.

    Examples:
        >>> t = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
        >>> t += "{% if add_generation_prompt %}<assistant>{% endif %}"
        >>> render_chat_template(t, [{"role": "user", "content": "hi"}])
        '<user>hi\n<assistant>'
    """
    import jinja2

    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise ChatTemplateError("messages must be a list of dicts")
    try:
        compiled = _compile(template)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"the chat template does not compile: {e}") from None
    try:
        return compiled.render(
            messages=messages,
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **special_tokens,
        )
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"the chat template failed to render: {e}") from None


# --8<-- [end:render_chat_template]
