"""Images in conversations: the placeholder tokens, reading an image, the processor and expanding pads."""

from __future__ import annotations

import base64
import binascii
import io
import json
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sft_trainer.data.conversations import _describe


@dataclass(frozen=True)
class VisionTokens:
    """The image placeholder tokens of a VL tokenizer (the defaults are Qwen2-VL's to Qwen3.5-VL's strings).

    The chat template renders an image as ``vision_start + image_pad + vision_end``; the pad is expanded to the
    image's token count. None of them may appear in message text, and none carries loss. Pass another instance
    (``tokenize_conversation(..., vision_tokens=VisionTokens(image_pad="<image>"))``) for other spellings.
    """

    image_pad: str = "<|image_pad|>"
    vision_start: str = "<|vision_start|>"
    vision_end: str = "<|vision_end|>"
    video_pad: str = "<|video_pad|>"

    def ids(self, tokenizer: Any) -> dict[str, int]:
        """``{"image_pad": id, ...}`` for the tokens ``tokenizer`` has as single tokens (absent ones left out)."""
        found = {}
        for name, token in vars(self).items():  # the fields; asdict's deep copy is slow once a row
            token_id = tokenizer.convert_tokens_to_ids(token)  # no get_vocab(): that copies the whole vocabulary
            if isinstance(token_id, int) and tokenizer.convert_ids_to_tokens(token_id) == token:
                found[name] = token_id
        return found


def conversation_images(messages: Sequence[Mapping[str, Any]]) -> list[tuple[str, Any]]:
    """``(where, image)`` of each image part of validated ``messages``, in order (``where``:
    ``messages[i].content[j]``)."""
    return [
        (f"messages[{i}].content[{j}]", part["image"])
        for i, message in enumerate(messages)
        if isinstance(message["content"], list)
        for j, part in enumerate(message["content"])
        if part["type"] == "image"
    ]


def load_image(image: Any, base_dir: str | os.PathLike | None = None, outside_ok: bool = False):
    """An RGB ``PIL.Image`` from an image part's value: a path (relative to ``base_dir``, default the working
    directory), a ``data:image/...;base64,`` URI, bytes, or ``{"bytes", "path"}``. With ``base_dir`` a path must
    stay inside it (not absolute, no ``..`` leading out, symlinks resolved) unless ``outside_ok``. Raises
    ``ValueError`` saying which file or how many bytes failed, and why."""
    from PIL import Image

    if isinstance(image, Mapping):
        if isinstance(image.get("bytes"), str) and image["bytes"]:  # an HF Image column written out as JSON
            raise ValueError(
                "an image's 'bytes' must be raw bytes, not text; in JSON give the image as a "
                "'data:image/...;base64,<data>' URI or as a file path"
            )
        image = image.get("bytes") or image.get("path")
    if isinstance(image, str) and image.startswith("data:"):
        header, sep, payload = image.partition(",")
        if not sep or not header.endswith(";base64"):
            raise ValueError(f"image data URI {_describe(image)}: only data:image/...;base64,<data> URIs are read")
        try:
            image = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ValueError(f"image data URI {_describe(image)} is not valid base64 ({exc})") from None
    if isinstance(image, str):
        if image.startswith(("http://", "https://")):
            raise ValueError(f"image {image!r}: URLs are not fetched; download the images and give their paths")
        path = Path(image.removeprefix("file://"))
        if base_dir is not None:
            inside = (Path(base_dir) / path).resolve().is_relative_to(Path(base_dir).resolve())
            if not outside_ok and (path.is_absolute() or not inside):
                raise ValueError(
                    f"image path {image!r} leads outside the dataset's folder {str(base_dir)!r}; give paths relative "
                    "to it, or set data.image_paths_outside = true to allow others"
                )
            path = Path(base_dir) / path
        try:
            if not path.is_file():
                what = (
                    "is a folder" if path.is_dir() else "is not a regular file" if path.exists() else "does not exist"
                )
                raise ValueError(f"image file '{path}' {what}")
        except OSError as exc:  # a name too long for the file system, say
            raise ValueError(f"image path {_describe(str(path))}: {exc.strerror or exc}") from None
        source, label = path, f"image file '{path}'"
    elif isinstance(image, bytes):
        source, label = io.BytesIO(image), f"image of {len(image)} bytes"
    else:
        raise ValueError(f"cannot read an image from {_describe(image)}")
    try:
        with warnings.catch_warnings():  # a large image is read (the processor resizes it); past 2x the limit, refused
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(source) as opened:
                return _to_rgb(opened)
    except ValueError:
        raise
    except Image.UnidentifiedImageError:
        raise ValueError(f"cannot decode {label}: not an image format Pillow reads") from None
    except Exception as exc:  # PIL raises several types (OSError, SyntaxError, DecompressionBombError, ...)
        raise ValueError(f"cannot decode {label}: {exc}") from None


def _to_rgb(image):
    """8-bit RGB. 16-bit grayscale (modes I;16*, and I as PNG and TIFF give it) is scaled to 8 bits: Pillow's own
    conversion clips every value above 255, which turns such an image nearly white."""
    from PIL import Image

    if image.mode == "F":
        raise ValueError(f"a floating-point image (mode {image.mode}) has no fixed range: save it as 8-bit")
    if image.mode == "I" or image.mode.startswith("I;16"):
        import numpy as np

        wide = np.asarray(image, dtype=np.float64)
        image = Image.fromarray(np.clip(np.rint(wide / 257.0), 0, 255).astype(np.uint8), mode="L")
    return image.convert("RGB")


def load_image_processor(folder: str | os.PathLike):
    """The image processor of a processor folder (``preprocessor_config.json``), on its Pillow backend.

    Pillow, not torchvision, so pixel values do not depend on what else is installed (and torchvision is not
    needed): ``AutoImageProcessor`` with ``backend="pil"``, or where ``AutoImageProcessor`` itself demands
    torchvision (transformers 5.17), the config's ``<image_processor_type>Pil`` class directly.
    """
    import transformers
    from transformers import AutoImageProcessor

    config = Path(folder) / "preprocessor_config.json"
    if Path(folder).is_dir() and not config.is_file():
        raise FileNotFoundError(
            f"{folder}: no preprocessor_config.json; data.processor must be a folder with the image processor's "
            "config (a Qwen3.5-VL checkpoint folder has one)"
        )
    try:
        return AutoImageProcessor.from_pretrained(folder, backend="pil")
    except ImportError:
        kind = json.loads(config.read_text()).get("image_processor_type", "")
        pil = getattr(transformers, kind.removesuffix("Fast").removesuffix("Pil") + "Pil", None)
        if pil is None:
            raise
        return pil.from_pretrained(folder)


def load_processor(folder: str | os.PathLike) -> tuple[Any, Any]:
    """``(tokenizer, image_processor)`` of a processor (or VL checkpoint) folder: ``AutoTokenizer`` and
    :func:`load_image_processor`."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder), load_image_processor(folder)


def _pad_runs(ids: Sequence[int], pad: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each maximal run of ``pad`` in ``ids``."""
    runs: list[tuple[int, int]] = []
    start = None
    for t, token in enumerate(ids):
        if token == pad:
            if start is None:
                start = t
        elif start is not None:
            runs.append((start, t))
            start = None
    if start is not None:
        runs.append((start, len(ids)))
    return runs


def _refuse_placeholder_text(messages: Sequence[Mapping[str, Any]], tokens: VisionTokens, ids: Mapping) -> None:
    """A placeholder typed into text would be tokenized as one and taken for an image (or break the counts)."""
    present = [token for name, token in vars(tokens).items() if name in ids]  # vars: asdict deep-copies
    for i, message in enumerate(messages):
        content = message["content"]
        texts = [content] if isinstance(content, str) else [p["text"] for p in content if p["type"] == "text"]
        for token in present:
            if any(token in text for text in texts):
                raise ValueError(
                    f"messages[{i}] ({message['role']}) text holds the image placeholder token {token!r}: give images "
                    "as {'type': 'image'} parts; a placeholder in text would be taken for an image"
                )
