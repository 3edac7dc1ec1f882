"""Rendering a conversation with its chat template and tokenizing it with an exact assistant loss mask."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sft_trainer.data.images import VisionTokens, _pad_runs, _refuse_placeholder_text, conversation_images, load_image
from sft_trainer.data.render import ChatRenderer, render_time_limit

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, eq=False)
class TokenizedConversation:
    """Token ids of one rendered conversation and its loss mask (1 on assistant reply tokens), and its images as
    the image processor gives them. Unpacks as ``ids, mask = conversation``."""

    input_ids: list[int]
    loss_mask: list[int]
    pixel_values: torch.Tensor | None = None
    """float32 [patches, C * T * P * P]: the conversation's images in order; None without images."""
    image_grid_thw: torch.Tensor | None = None
    """int64 [images, 3]: each image's (t, h, w) patch grid; it has ``t * h * w / merge_size**2`` pad tokens."""
    image_spans: tuple[tuple[int, int], ...] = ()
    """``[start, end)`` token range of each image: its vision start, pads and vision end."""

    def __iter__(self) -> Iterator[list[int]]:
        return iter((self.input_ids, self.loss_mask))

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def num_images(self) -> int:
        return len(self.image_spans)


def _default_end_of_turn(tokenizer: Any) -> str | None:
    vocab = tokenizer.get_vocab()
    if "<|im_end|>" in vocab:
        return "<|im_end|>"
    return tokenizer.eos_token


def _find_reply(full: str, start: int, text: str) -> tuple[int, int] | None:
    """Where ``text`` (or, for templates that trim replies, its stripped form) first occurs at or after ``start``."""
    found = full.find(text, start)
    if found < 0:
        text = text.strip()
        found = full.find(text, start) if text else start
    return None if found < 0 else (found, found + len(text))


def assistant_spans(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    end_of_turn: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    vision_tokens: VisionTokens | None = None,
    renderer: ChatRenderer | None = None,
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans ``[start, end)`` of its assistant replies.

    A span starts where the generation prompt of the conversation so far ends and runs to the end of the
    reply's content plus the ``end_of_turn`` marker that follows it (when only whitespace lies between).
    Empty replies get no span. Raises ``ValueError`` if the template is not prefix-stable (the conversation
    up to a reply plus its generation prompt is not a prefix of the whole rendering).

    A reply given as parts is found part by part: its text parts in order; images rendered after its last text
    (``vision_tokens``) may lie before the end-of-turn marker. A span may thus hold image placeholders; they get
    no loss (:func:`tokenize_conversation` zeroes the mask on every vision token). A reply without text is empty.

    ``renderer`` (a :class:`~sft_trainer.data.render.ChatRenderer` of ``tokenizer`` and ``chat_template_kwargs``)
    saves preparing the template for every conversation when many are rendered.
    """
    if renderer is None:
        renderer = ChatRenderer(tokenizer, chat_template_kwargs)
    if end_of_turn is None:
        end_of_turn = _default_end_of_turn(tokenizer)
    markup = list(vars(vision_tokens or VisionTokens()).values())  # vars, not asdict: this runs once a row
    with render_time_limit():  # the renderings (the template's code) and the searches in them
        return _spans(renderer, messages, end_of_turn, markup)


_STAND_IN = "sft-train-reply-stand-in-7f3a9c"


def _before_first_reply(renderer: ChatRenderer, messages: list[dict[str, Any]]) -> str | None:
    """What the template renders before the text of a reply that opens the conversation (a default system
    prompt, the role header): the conversation rendered with a stand-in for that reply's content, up to the
    stand-in (the whole conversation, as templates that look for a user turn need it). None when the template
    drops the stand-in."""
    stand_in = [{**messages[0], "content": _STAND_IN}, *messages[1:]]
    rendered = renderer.render(renderer.prepare(stand_in), False)
    at = rendered.find(_STAND_IN)
    return None if at < 0 else rendered[:at]


def _spans(
    renderer: ChatRenderer, messages: list[dict[str, Any]], end_of_turn: str | None, markup: list[str]
) -> tuple[str, list[tuple[int, int]]]:
    prepared = renderer.prepare(messages)
    full = renderer.render(prepared, False)
    spans: list[tuple[int, int]] = []
    cursor = 0
    for i, message in enumerate(messages):
        content = message["content"]
        texts = [content] if isinstance(content, str) else [p["text"] for p in content if p["type"] == "text"]
        if message["role"] != "assistant" or not any(texts):
            continue
        # a reply at messages[0] has nothing before it to render (apply_chat_template refuses an empty list)
        prefix = _before_first_reply(renderer, messages) if i == 0 else renderer.render(prepared[:i], True)
        if prefix is None or not full.startswith(prefix):
            raise ValueError(
                f"the chat template is not prefix-stable at messages[{i}]: rendering the messages before it with "
                "add_generation_prompt=True is not a prefix of the whole conversation's rendering"
            )
        start = end = len(prefix)
        for text in filter(None, texts):
            found = _find_reply(full, end, text)
            if found is None:
                raise ValueError(
                    f"the content of messages[{i}] (assistant) does not appear in the rendered template (a chat "
                    "template that drops or rewrites replies cannot mark them for the loss)"
                )
            end = found[1]
        if end_of_turn:
            marker = full.find(end_of_turn, end)
            between = full[end:marker]
            if not isinstance(content, str):  # images after a reply's last text part
                for token in markup:
                    between = between.replace(token, "")
            if marker >= 0 and not between.strip():
                end = marker + len(end_of_turn)
        if start < cursor:
            raise ValueError(f"the reply span of messages[{i}] overlaps the previous one")
        spans.append((start, end))
        cursor = end
    return full, spans


def tokenize_conversation(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    end_of_turn: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    image_processor: Any = None,
    base_dir: str | os.PathLike | None = None,
    vision_tokens: VisionTokens | None = None,
    image_paths_outside: bool = False,
    renderer: ChatRenderer | None = None,
) -> TokenizedConversation:
    """Token ids of ``messages`` rendered with the tokenizer's chat template, and the assistant loss mask.

    ``loss_mask[t] == 1`` exactly on the tokens of assistant replies: content and the ``end_of_turn`` marker
    (default ``<|im_end|>`` when the vocabulary has it, else the eos token). Empty replies add no loss tokens.
    The text is tokenized in pieces cut at the reply boundaries (no special tokens added beyond the
    template's own), which is how a prompt and the reply generated after it are tokenized at inference.

    Image parts (paths relative to ``base_dir``, default the working directory) are loaded as RGB and run through
    ``image_processor`` in one call; each image's single ``vision_tokens.image_pad`` becomes ``t * h * w //
    merge_size**2`` pads, ``(t, h, w)`` its ``image_grid_thw``. Vision tokens never carry loss. Raises
    ``ValueError`` for images without a processor or unreadable, a template that drops images, pad counts that
    do not match the grids, and placeholder tokens typed into the text. ``renderer``: as in
    :func:`assistant_spans` (one made for ``tokenizer`` and ``chat_template_kwargs`` is reused across calls).
    """
    pieces = conversation_pieces(
        tokenizer,
        messages,
        end_of_turn=end_of_turn,
        chat_template_kwargs=chat_template_kwargs,
        image_processor=image_processor,
        vision_tokens=vision_tokens,
        renderer=renderer,
    )
    encoded = encode_texts(tokenizer, pieces.texts)
    return finish_conversation(pieces, encoded, image_processor, base_dir, image_paths_outside)


@dataclass(frozen=True, eq=False)
class ConversationPieces:
    """A checked conversation rendered and cut at its reply boundaries, not yet tokenized."""

    texts: list[str]
    """The rendering in order, cut where replies start and end; no empty text."""
    flags: list[int]
    """1 for a reply's text (its tokens carry loss), else 0."""
    images: list[tuple[str, Any]]
    tokens: VisionTokens
    ids: dict[str, int]
    """The ids of ``tokens`` the tokenizer has."""


def conversation_pieces(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    end_of_turn: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    image_processor: Any = None,
    vision_tokens: VisionTokens | None = None,
    renderer: ChatRenderer | None = None,
) -> ConversationPieces:
    """The first half of :func:`tokenize_conversation`: its checks that need no tokens, the rendering and its
    pieces. :func:`encode_texts` of the texts (of one or many conversations) and :func:`finish_conversation` give
    its result."""
    if renderer is None:
        renderer = ChatRenderer(tokenizer, chat_template_kwargs)
    tokens = vision_tokens or VisionTokens()
    ids = renderer.vision_ids(tokens)
    images = conversation_images(messages)
    _refuse_placeholder_text(messages, tokens, ids)
    if images and image_processor is None:
        raise ValueError(
            f"the conversation has {len(images)} image(s) but no image processor is set: train a Qwen3.5-VL model "
            "(model.preset = 'tiny-qwen3_5-vl' or a VL checkpoint) with data.processor naming its processor folder "
            "(with preprocessor_config.json); from Python, pass image_processor="
        )
    if images and "image_pad" not in ids:
        raise ValueError(
            f"the conversation has {len(images)} image(s) but the tokenizer has no {tokens.image_pad!r} token: use "
            "the VL model's tokenizer (its processor folder)"
        )
    full, spans = assistant_spans(
        tokenizer,
        messages,
        end_of_turn=end_of_turn,
        chat_template_kwargs=chat_template_kwargs,
        vision_tokens=tokens,
        renderer=renderer,
    )
    texts: list[str] = []
    flags: list[int] = []
    cursor = 0
    for start, end in spans:
        for text, flag in ((full[cursor:start], 0), (full[start:end], 1)):
            if text:
                texts.append(text)
                flags.append(flag)
        cursor = end
    if full[cursor:]:
        texts.append(full[cursor:])
        flags.append(0)
    return ConversationPieces(texts, flags, images, tokens, ids)


def plain_text(pieces: ConversationPieces, encoded: list[list[int]]) -> bool:
    """Whether :func:`finish_conversation` gives just the pieces' ids back to back, each token flagged as its
    piece: no images, and no image pad token rendered by the template (which it refuses)."""
    pad = pieces.ids.get("image_pad")
    return not pieces.images and (pad is None or not any(pad in piece_ids for piece_ids in encoded))


def finish_conversation(
    pieces: ConversationPieces,
    encoded: list[list[int]],
    image_processor: Any = None,
    base_dir: str | os.PathLike | None = None,
    image_paths_outside: bool = False,
) -> TokenizedConversation:
    """The conversation's ids and mask from its pieces' ids (``encoded``), its images expanded (see
    :func:`tokenize_conversation`)."""
    input_ids: list[int] = []
    loss_mask: list[int] = []
    for piece_ids, flag in zip(encoded, pieces.flags, strict=True):
        input_ids.extend(piece_ids)
        loss_mask.extend([flag] * len(piece_ids))
    if not pieces.ids:  # a text tokenizer, a text conversation
        return TokenizedConversation(input_ids, loss_mask)
    return _expand_images(
        input_ids,
        loss_mask,
        pieces.images,
        pieces.tokens,
        pieces.ids,
        image_processor,
        base_dir,
        image_paths_outside,
    )


def encode_texts(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Each text's token ids, no special tokens added (each text alone: one call for many conversations gives the
    ids of one call each). A fast tokenizer's Rust backend is called directly, without
    offsets (most of a build's time is this call), when it is set up as ``tokenizer(texts)`` would leave it (no
    truncation or padding, special tokens not split); else ``tokenizer(texts, add_special_tokens=False)``."""
    backend = getattr(tokenizer, "_tokenizer", None)
    encode = getattr(backend, "encode_batch_fast", None)
    if (
        encode is not None
        and backend.truncation is None
        and backend.padding is None
        and backend.encode_special_tokens == bool(getattr(tokenizer, "split_special_tokens", False))
    ):
        return [encoding.ids for encoding in encode(texts, add_special_tokens=False)]
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def _expand_images(
    input_ids: list[int],
    loss_mask: list[int],
    images: list[tuple[str, Any]],
    tokens: VisionTokens,
    ids: Mapping[str, int],
    image_processor: Any,
    base_dir: str | os.PathLike | None,
    outside_ok: bool = False,
) -> TokenizedConversation:
    """Check the rendered placeholders against the image parts, run the images through the processor, expand
    each image's pad to its grid's token count, and zero the loss mask on every vision token."""
    import torch

    if "image_pad" not in ids:  # a text tokenizer: no placeholders to check (images were refused earlier)
        return TokenizedConversation(input_ids, loss_mask)
    pad = ids["image_pad"]
    runs = _pad_runs(input_ids, pad)
    if len(runs) != len(images):
        what = "images without tokens" if len(runs) < len(images) else "image tokens without images"
        raise ValueError(
            f"{what}: the chat template rendered {len(runs)} {tokens.image_pad} placeholder(s) for {len(images)} "
            f"image part(s); it must render each image part once (Qwen-VL: {tokens.vision_start}{tokens.image_pad}"
            f"{tokens.vision_end})"
        )
    if not images:
        return TokenizedConversation(input_ids, loss_mask)
    pictures = []
    for where, image in images:
        try:
            pictures.append(load_image(image, base_dir, outside_ok))
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
    try:
        processed = image_processor(images=pictures, return_tensors="pt")
    except ValueError as exc:
        raise ValueError(f"the image processor refused the conversation's images: {exc}") from None
    grids = torch.as_tensor(processed["image_grid_thw"]).to(torch.int64).reshape(-1, 3)
    pixels = torch.as_tensor(processed["pixel_values"]).to(torch.float32)
    merge = getattr(image_processor, "merge_size", None)
    if not isinstance(merge, int) or merge < 1:
        raise ValueError(f"the image processor has no integer merge_size (got {merge!r}); a Qwen2-VL one is needed")
    patches = grids.prod(-1)
    if len(grids) != len(images) or pixels.size(0) != int(patches.sum()) or (patches % merge**2).any():
        raise ValueError(
            f"the image processor gave grids {grids.tolist()} and {pixels.size(0)} patch rows for {len(images)} "
            f"image(s) with merge_size {merge}"
        )
    counts = (patches // merge**2).tolist()
    start_id, end_id = ids.get("vision_start"), ids.get("vision_end")
    out_ids: list[int] = []
    out_mask: list[int] = []
    spans: list[tuple[int, int]] = []
    cursor = 0
    for k, ((start, end), count) in enumerate(zip(runs, counts, strict=True)):
        if end - start not in (1, count):  # one pad to expand, or already the image's count
            raise ValueError(
                f"image-token counts that do not match grids: image {k} ({images[k][0]}) has {end - start} "
                f"{tokens.image_pad} tokens, its grid {grids[k].tolist()} needs {count} (or 1, to be expanded)"
            )
        out_ids += input_ids[cursor:start]
        out_mask += loss_mask[cursor:start]
        first = len(out_ids) - 1 if out_ids and out_ids[-1] == start_id else len(out_ids)
        out_ids += [pad] * count
        out_mask += [0] * count
        last = len(out_ids) + 1 if end < len(input_ids) and input_ids[end] == end_id else len(out_ids)
        spans.append((first, last))  # the image's tokens: its vision start, pads and vision end
        cursor = end
    out_ids += input_ids[cursor:]
    out_mask += loss_mask[cursor:]
    vision = set(ids.values())  # never loss on a vision token, wherever the image sits (even in a reply)
    out_mask = [0 if token in vision else flag for token, flag in zip(out_ids, out_mask, strict=True)]
    return TokenizedConversation(out_ids, out_mask, pixels, grids, tuple(spans))
