"""The chat renderer: rendering through the compiled template directly gives the same ids, loss masks and images as
rendering every time through ``apply_chat_template``, for the shipped tokenizers and for templates with system
prompts, tools, template variables and trimmed replies, over varied conversations; the sandbox still holds."""

from __future__ import annotations

import copy
import random

import jinja2
import pytest

from sft_trainer.data import (
    load_conversations,
    load_processor,
    tiny_tokenizer_dir,
    tiny_vl_chat_path,
    tiny_vl_processor_dir,
    tokenize_conversation,
)
from sft_trainer.data.render import ChatRenderer, ChatTemplateError

IMAGES = tiny_vl_chat_path().parent

# A Qwen-style template: a default system prompt, tools listed in the system turn, replies trimmed, the special
# tokens map (eos_token) and a template variable (enable_thinking) read.
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{%- if messages[0].role == 'system' %}{{ messages[0].content }}\n"
    "{%- endif %}# Tools\n{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}<|im_end|>\n"
    "{%- elif messages[0].role != 'system' %}<|im_start|>system\nYou are helpful.<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}{%- if m.role == 'system' and (loop.first and not tools) %}"
    "<|im_start|>system\n{{ m.content }}<|im_end|>\n"
    "{%- elif m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content | trim }}<|im_end|>\n"
    "{%- elif m.role != 'system' %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{%- endif %}{%- endif %}"
    "{{- '' if eos_token else 'no eos' }}"
)
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}]

WORDS = ["hello", "world", " spaced ", "line\nbreak", "ünïcödé", "<|im_end|>", "  ", "", "ok.", "x" * 40]


def _text(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 6)))


def _conversations(rng: random.Random, count: int, images: bool = False) -> list[list[dict]]:
    """Multi-turn, with or without a system prompt, empty and whitespace-only turns, special-token strings in the
    text, an assistant first now and then (which no template can render a prompt for), images in parts."""
    out = []
    for _ in range(count):
        messages = [{"role": "system", "content": _text(rng)}] if rng.random() < 0.4 else []
        first = "assistant" if rng.random() < 0.05 else "user"
        for turn in range(rng.randint(1, 4)):
            for role in ("user", "assistant") if turn or first == "user" else ("assistant",):
                content: str | list = _text(rng)
                if images and rng.random() < 0.5:
                    parts = [{"type": "text", "text": _text(rng)}] if rng.random() < 0.8 else []
                    for _ in range(rng.randint(1, 2)):
                        parts.insert(
                            rng.randint(0, len(parts)), {"type": "image", "image": f"images/000{rng.randint(0, 9)}.png"}
                        )
                    content = parts
                messages.append({"role": role, "content": content})
        out.append(messages)
    return out


def _outcome(tokenizer, messages, renderer, **kwargs):
    """The tokenized conversation as plain values, or the error it raised (type and message)."""
    try:
        doc = tokenize_conversation(tokenizer, copy.deepcopy(messages), renderer=renderer, **kwargs)
    except (ValueError, jinja2.TemplateError) as exc:
        return type(exc).__name__, str(exc)
    pixels = None if doc.pixel_values is None else doc.pixel_values.numpy().tobytes()
    grids = None if doc.image_grid_thw is None else doc.image_grid_thw.tolist()
    return doc.input_ids, doc.loss_mask, pixels, grids, doc.image_spans


def _assert_same(tokenizer, conversations, kwargs=None, **tokenize_kwargs) -> int:
    """Every conversation tokenized through the direct renderer equals apply_chat_template's; returns how many
    tokenized without error (so that a test can require enough of them)."""
    direct = ChatRenderer(tokenizer, kwargs)
    reference = ChatRenderer(tokenizer, kwargs, direct=False)
    assert direct.direct and not reference.direct
    ok = 0
    for messages in conversations:
        want = _outcome(tokenizer, messages, reference, chat_template_kwargs=kwargs, **tokenize_kwargs)
        got = _outcome(tokenizer, messages, direct, chat_template_kwargs=kwargs, **tokenize_kwargs)
        assert got == want, messages
        ok += isinstance(want[0], list)
    assert direct.direct  # its first renderings matched apply_chat_template's: it never fell back
    return ok


@pytest.fixture(scope="module")
def text_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir())


@pytest.fixture(scope="module")
def vl_pair():
    return load_processor(tiny_vl_processor_dir())


def test_shipped_text_tokenizer(text_tokenizer):
    conversations = _conversations(random.Random(0), 300)
    assert _assert_same(text_tokenizer, conversations) >= 250


def test_shipped_vl_tokenizer_with_images(vl_pair):
    tokenizer, processor = vl_pair
    conversations = _conversations(random.Random(1), 120, images=True)
    conversations += [c.messages for c in load_conversations(tiny_vl_chat_path())]
    ok = _assert_same(tokenizer, conversations, image_processor=processor, base_dir=IMAGES)
    assert ok >= 80


@pytest.mark.parametrize(
    ("kwargs", "tokenized"),
    [
        (None, range(120, 151)),
        ({"tools": TOOLS}, range(120, 151)),
        ({"tools": TOOLS, "enable_thinking": True}, range(120, 151)),
        # the prompt's empty think block is not in the rendered conversation: not prefix-stable, both paths say so
        ({"enable_thinking": False}, range(0, 20)),
    ],
)
def test_template_with_system_tools_and_variables(text_tokenizer, kwargs, tokenized):
    tokenizer = copy.deepcopy(text_tokenizer)
    tokenizer.chat_template = TOOLS_TEMPLATE
    assert _assert_same(tokenizer, _conversations(random.Random(2), 150), kwargs) in tokenized


def test_named_templates_pick_the_tool_template(text_tokenizer):
    tokenizer = copy.deepcopy(text_tokenizer)
    tokenizer.chat_template = {"default": text_tokenizer.chat_template, "tool_use": TOOLS_TEMPLATE}
    conversations = _conversations(random.Random(3), 60)
    assert _assert_same(tokenizer, conversations, {"tools": TOOLS}) >= 45
    with_tools = ChatRenderer(tokenizer, {"tools": TOOLS})
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    assert "# Tools" in with_tools.render(with_tools.prepare(messages), False)


def test_what_the_direct_path_does_not_handle_goes_through_apply_chat_template(text_tokenizer):
    def add(a: int, b: int) -> int:
        """Add.

        Args:
            a: one
            b: two
        """
        return a + b

    tokenizer = copy.deepcopy(text_tokenizer)
    tokenizer.chat_template = TOOLS_TEMPLATE
    assert not ChatRenderer(tokenizer, {"tools": [add]}).direct  # a callable needs transformers' schema
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    got = tokenize_conversation(tokenizer, messages, chat_template_kwargs={"tools": [add]})
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, tools=[add])
    assert tokenizer.decode(got.input_ids) == rendered and '"name": "add"' in rendered


def test_a_first_rendering_that_differs_switches_to_apply_chat_template(text_tokenizer):
    renderer = ChatRenderer(text_tokenizer)
    renderer._template = jinja2.Template("something else")
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    want = text_tokenizer.apply_chat_template(messages, tokenize=False)
    assert renderer.render(renderer.prepare(messages), False) == want
    assert not renderer.direct


def test_messages_of_plain_strings_skip_the_preparation_walk_with_the_same_renderings(text_tokenizer):
    class Role(str):
        pass

    renderer = ChatRenderer(text_tokenizer)
    reply = {"role": "assistant", "content": "ok", "reasoning_content": "think"}  # aliased either way
    variants = [
        [{"role": "user", "content": "hi"}, reply],
        [{"role": "user", "content": "hi", "name": None}, reply],  # None fields are dropped: the walk
        [{"role": Role("user"), "content": "hi"}, reply],  # a str subclass becomes a str: the walk
    ]
    for messages in variants:
        prepared = renderer.prepare(messages)
        assert prepared == [{"role": "user", "content": "hi"}, {"thinking": "think", **reply}]
        for k, prompt in ((1, True), (2, False)):
            want = text_tokenizer.apply_chat_template(messages[:k], tokenize=False, add_generation_prompt=prompt)
            assert renderer.render(prepared[:k], prompt) == want
    assert renderer._strings_as_is is True and renderer.direct
    assert variants[0][1] == {
        "role": "assistant",
        "content": "ok",
        "reasoning_content": "think",
    }  # not aliased in place


def test_the_template_still_runs_in_the_sandbox(text_tokenizer):
    tokenizer = copy.deepcopy(text_tokenizer)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    for template in ("{{ messages.append(1) }}", "{{ ''.__class__.__mro__[1].__subclasses__() }}"):
        tokenizer.chat_template = template
        renderer = ChatRenderer(tokenizer)
        renderer._unchecked = False  # the direct path alone
        assert renderer.direct
        with pytest.raises(ChatTemplateError, match="SecurityError") as info:
            renderer.render(renderer.prepare(messages), False)
        assert isinstance(info.value.__cause__, jinja2.exceptions.SecurityError)


def test_no_template_is_reported_as_before(text_tokenizer):
    tokenizer = copy.deepcopy(text_tokenizer)
    tokenizer.chat_template = None
    renderer = ChatRenderer(tokenizer)
    assert not renderer.direct
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    with pytest.raises(ValueError, match="chat template"):
        tokenize_conversation(tokenizer, messages, renderer=renderer)


def test_a_template_that_loops_for_hours_stops_at_the_time_limit(text_tokenizer, monkeypatch):
    """Nested loops within the sandbox's range limit (10^10 iterations) stop at the limit with ChatTemplateError;
    the process's own SIGALRM handler comes back, and a fast template renders under the same limit."""
    import signal
    import time

    from sft_trainer.data import render

    monkeypatch.setattr(render, "RENDER_LIMIT_S", 0.5)
    tokenizer = copy.deepcopy(text_tokenizer)
    tokenizer.chat_template = (
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}{{ messages[0].content }}"
    )
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    previous = signal.getsignal(signal.SIGALRM)
    started = time.monotonic()
    with pytest.raises(ChatTemplateError, match=r"rendering one conversation ran past 0\.5 s"):
        tokenize_conversation(tokenizer, messages)
    assert time.monotonic() - started < 10
    assert signal.getsignal(signal.SIGALRM) is previous and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert len(tokenize_conversation(text_tokenizer, messages).input_ids) > 0
