"""Rendering conversations with a tokenizer's chat template, cheaply and exactly as ``apply_chat_template`` does.

A conversation's loss mask needs several renderings of it (the whole, and the part before each reply with the
generation prompt). ``apply_chat_template`` rebuilds its inputs on every call (message normalisation, the special
tokens, the template lookup), which costs several times the template itself. :class:`ChatRenderer` does that
work once: per tokenizer the template and its variables, per conversation the messages (every step of the
preparation maps message by message, so the messages before a reply are a slice of the prepared list). The
template runs compiled by transformers in its immutable Jinja sandbox, as in ``apply_chat_template``. Messages of
plain strings (text rows of JSONL and Parquet files) skip transformers' walk over the messages, which copies them
unchanged (checked against it on the first such conversation).

The direct path needs transformers' chat-template helpers; where they are missing, or where its first renderings
differ from ``apply_chat_template``'s, every rendering goes through ``apply_chat_template``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Mapping
from typing import Any

from sft_trainer.data.images import VisionTokens
from sft_trainer.job_failure import one_line
from sft_trainer.time_limit import time_limit

# apply_chat_template's own parameters that may come in chat_template_kwargs and that the direct path handles
_HANDLED = {"tools", "documents", "chat_template"}
RENDER_LIMIT_S = 60.0  # one conversation's renderings; a real template takes milliseconds


def _without_payloads(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Templates see image parts without their payload (bytes or a base64 wall have no business in the text)."""
    return [
        {**m, "content": [p if p["type"] == "text" else {"type": "image", "image": "image"} for p in m["content"]]}
        if isinstance(m["content"], list)
        else m
        for m in messages
    ]


def _only_strings(message: Any) -> bool:
    """A plain dict of plain strings, as a text message from a JSON or Parquet file is."""
    return type(message) is dict and all(type(k) is str and type(v) is str for k, v in message.items())


def _template_helpers() -> tuple[Any, ...] | None:
    try:
        from transformers.utils.chat_template_utils import (
            _alias_reasoning_fields,
            _compile_jinja_template,
            _normalize_chat_messages,
            _plain_template_data,
        )
    except ImportError:
        return None
    return _compile_jinja_template, _normalize_chat_messages, _plain_template_data, _alias_reasoning_fields


@functools.lru_cache
def _apply_parameters(tokenizer_class: type) -> frozenset[str]:
    """``apply_chat_template``'s own parameters that the direct path does not handle."""
    return frozenset(inspect.signature(tokenizer_class.apply_chat_template).parameters) - _HANDLED


class ChatTemplateError(Exception):
    """The chat template failed while rendering: its own ``raise_exception``, a refusal of its sandbox, or an error
    in its code (a type error, a division by zero). A ValueError stays a ValueError: the row's data is at fault."""


class ChatTemplateTimeout(ChatTemplateError):
    """The chat template ran past the time limit on one conversation: it stops the job rather than a row, as every
    row would take as long."""


def as_row_error(exc: ChatTemplateError, messages: list[dict[str, Any]]) -> ValueError:
    """A template that fails on one conversation (its role checks, a type it does not take) fails on that row:
    returned as the row's ValueError, named with its file and row and skipped under ``on_error="skip"``. A refusal
    of the sandbox (an unsafe access, a range over its limit) or the time limit is the template's whatever the
    row: re-raised, it stops the job naming the tokenizer."""
    from jinja2.exceptions import SecurityError

    cause = exc.__cause__
    if isinstance(exc, ChatTemplateTimeout) or isinstance(cause, SecurityError | OverflowError):
        raise exc
    text_parts = [m["content"] for m in messages if isinstance(m["content"], list)]
    parts_hint = isinstance(cause, TypeError) and text_parts and all(p["type"] == "text" for c in text_parts for p in c)
    hint = "; its content is a list of text parts, which this template may not take: give text as a string"
    return ValueError(f"the chat template fails on this conversation: {exc}{hint if parts_hint else ''}")


def chat_template_problem(tokenizer: Any) -> str | None:
    """Why ``tokenizer``'s chat template cannot render a conversation at all (none set, or it does not compile),
    else None: known from the template alone, before any row is rendered."""
    try:
        template = tokenizer.get_chat_template()
    except ValueError as exc:
        return f"has no chat template ({one_line(exc, 200)}); sft-train renders every conversation with it"
    helpers = _template_helpers()
    if helpers is None:
        return None  # the rows' renderings say it
    try:
        helpers[0](template)
    except ImportError:
        return None
    except Exception as exc:  # jinja2's TemplateSyntaxError, with the template's line
        lineno = getattr(exc, "lineno", None)
        return f"has a chat template that does not compile{f' (line {lineno})' if lineno else ''}: {one_line(exc)}"
    return _loads_other_templates(template)


def _loads_other_templates(template: str) -> str | None:
    """A template that includes, imports or extends another one cannot render: apply_chat_template gives its
    environment no loader (every row would fail with "no loader for this environment specified")."""
    import jinja2
    from jinja2 import nodes

    loading = (nodes.Include, nodes.Import, nodes.FromImport, nodes.Extends)
    try:  # transformers' own tags (e.g. {% generation %}) do not parse here: such a template is not judged
        parsed = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateSyntaxError:
        return None
    found = next(iter(parsed.find_all(loading)), None)
    if found is None:
        return None
    tag = {nodes.Include: "include", nodes.Import: "import", nodes.FromImport: "from", nodes.Extends: "extends"}
    return (
        f"has a chat template that loads another template ({{% {tag[type(found)]} %}}, line {found.lineno}), which "
        "apply_chat_template cannot: put the other template's text in place"
    )


def render_time_limit(seconds: float | None = None) -> contextlib.AbstractContextManager[None]:
    """Stop a chat template that runs past ``seconds`` (default :data:`RENDER_LIMIT_S`; a loop within the
    sandbox's range limit can still run for hours) with :class:`ChatTemplateError`: in a process's main thread on
    POSIX (the tokenizing processes, a rank), see :func:`sft_trainer.time_limit.time_limit`."""
    seconds = RENDER_LIMIT_S if seconds is None else seconds
    return time_limit(
        seconds,
        lambda: ChatTemplateTimeout(
            f"rendering one conversation ran past {seconds:g} s (a template that loops without end?)"
        ),
    )


class ChatRenderer:
    """``tokenizer``'s chat template with ``chat_template_kwargs``, for many conversations.

    ``prepare(messages)`` once per conversation, then ``render(prepared[:k], generation_prompt)`` for the whole
    or any leading part: the text ``tokenizer.apply_chat_template(messages[:k], tokenize=False,
    add_generation_prompt=generation_prompt, **chat_template_kwargs)`` returns, image parts without payloads.
    ``direct=False`` renders every time through ``apply_chat_template``.
    """

    def __init__(self, tokenizer: Any, chat_template_kwargs: Mapping[str, Any] | None = None, direct: bool = True):
        self.tokenizer = tokenizer
        self.kwargs = dict(chat_template_kwargs or {})
        self._vision_ids: dict[VisionTokens, dict[str, int]] = {}
        self._template = None
        self._unchecked = True  # the first rendering is compared with apply_chat_template's
        self._strings_as_is: bool | None = None  # see prepare; None until checked on a first conversation
        helpers = _template_helpers() if direct else None
        if helpers is None or not self._direct_kwargs_ok():
            return
        compile_template, self._normalize, self._plain, self._alias = helpers
        tools, documents = self.kwargs.get("tools"), self.kwargs.get("documents")
        variables = {k: v for k, v in self.kwargs.items() if k not in _HANDLED}
        try:
            template = compile_template(tokenizer.get_chat_template(self.kwargs.get("chat_template"), tools))
        except Exception:  # no template, or one that does not compile: apply_chat_template says so for each row
            return
        self._variables = {
            "tools": self._plain(tools),
            "documents": self._plain(documents),
            **self._plain({**tokenizer.special_tokens_map, **variables}),
        }
        self._template = template

    def _direct_kwargs_ok(self) -> bool:
        """Only template variables, and tools / documents as plain dicts (callables need transformers' schema)."""
        if _apply_parameters(type(self.tokenizer)) & set(self.kwargs):
            return False
        return all(
            self.kwargs.get(name) is None
            or (isinstance(self.kwargs[name], list) and all(isinstance(x, dict) for x in self.kwargs[name]))
            for name in ("tools", "documents")
        )

    @property
    def direct(self) -> bool:
        """Whether renderings call the compiled template directly (else ``apply_chat_template``)."""
        return self._template is not None

    def vision_ids(self, tokens: VisionTokens) -> dict[str, int]:
        """``tokens.ids(tokenizer)``, looked up once."""
        if tokens not in self._vision_ids:
            self._vision_ids[tokens] = tokens.ids(self.tokenizer)
        return self._vision_ids[tokens]

    def prepare(self, messages: list[dict[str, Any]]) -> list[Any]:
        """``messages`` as the template sees them (for :meth:`render`); each entry stands for one message."""
        messages = _without_payloads(messages)
        if self._template is None:
            return messages
        if self._strings_as_is is not False and all(_only_strings(m) for m in messages):
            # transformers' preparation copies such messages unchanged; its walk over them costs nearly as much as
            # the conversation's renderings. Checked against it on the first such conversation
            shortcut = self._alias([dict(m) for m in messages])
            if self._strings_as_is is None:
                self._strings_as_is = shortcut == self._alias(self._plain(self._normalize(messages)))
            if self._strings_as_is:
                return shortcut
        return self._alias(self._plain(self._normalize(messages)))

    def render(self, prepared: list[Any], generation_prompt: bool) -> str:
        try:
            return self._render(prepared, generation_prompt)
        except (ValueError, ChatTemplateError):
            raise
        except Exception as exc:
            raise ChatTemplateError(one_line(exc)) from exc

    def _render(self, prepared: list[Any], generation_prompt: bool) -> str:
        if self._template is not None and prepared:  # apply_chat_template refuses an empty list: let it say so
            text = self._template.render(messages=prepared, add_generation_prompt=generation_prompt, **self._variables)
            if self._unchecked:
                self._unchecked = False
                reference = self._reference(prepared, generation_prompt)
                if text != reference:  # transformers prepares differently here: its own path from now on
                    self._template = None
                    return reference
            return text
        return self._reference(prepared, generation_prompt)

    def _reference(self, prepared: list[Any], generation_prompt: bool) -> str:
        text = self.tokenizer.apply_chat_template(
            prepared, tokenize=False, add_generation_prompt=generation_prompt, **self.kwargs
        )
        if not isinstance(text, str):
            raise TypeError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}, expected str")
        return text
