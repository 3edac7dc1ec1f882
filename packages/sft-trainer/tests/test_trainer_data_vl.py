"""Packed chat data with images: the shipped VL processor and image chat data, image parts, placeholder expansion
to the processor's grids, the loss mask (never on vision tokens), packing that keeps images with their documents,
truncation that never cuts an image, Parquet / data-URI images, the broadcast, and every error."""

from __future__ import annotations

import base64
import contextlib
import importlib.util
import io
import json
import pickle
import random
import shutil
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoTokenizer

from cp_core.testing import GlooWorkers
from sft_trainer.data import (
    IGNORE_INDEX,
    DataError,
    PackedDataset,
    TokenizedConversation,
    VisionTokens,
    build_training_rows,
    collate_packed,
    load_conversations,
    load_image,
    load_processor,
    pack_examples,
    tiny_tokenizer_dir,
    tiny_vl_chat_path,
    tiny_vl_processor_dir,
    tokenize_conversation,
)

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "make_tiny_vl_assets.py"
IMAGES = tiny_vl_chat_path().parent / "images"
MERGE = 2  # the tiny processor's merge_size: an image has t * h * w / 4 pad tokens


@pytest.fixture(scope="module")
def processor_pair():
    return load_processor(tiny_vl_processor_dir())


@pytest.fixture(scope="module")
def tokenizer(processor_pair):
    return processor_pair[0]


@pytest.fixture(scope="module")
def processor(processor_pair):
    return processor_pair[1]


@pytest.fixture(scope="module")
def ids(tokenizer):
    names = ("vision_start", "vision_end", "image_pad", "video_pad")
    return dict(zip(names, tokenizer.convert_tokens_to_ids([f"<|{n}|>" for n in names]), strict=True))


@pytest.fixture(scope="module")
def shipped():
    return load_conversations(tiny_vl_chat_path())


def image_path(index: int) -> str:
    return str(IMAGES / f"{index:04d}.png")


def image_runs(tokens: list[int], pad: int) -> list[tuple[int, int]]:
    runs, start = [], None
    for t, token in enumerate([*tokens, -1]):
        if token == pad and start is None:
            start = t
        elif token != pad and start is not None:
            runs.append((start, t))
            start = None
    return runs


def masked_runs(ids: list[int], mask: list[int]) -> list[list[int]]:
    runs, current = [], []
    for token, flag in zip([*ids, -1], [*mask, 0], strict=True):
        if flag:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return runs


def conversation(*user_parts, answer="The square is red."):
    """A user turn of parts (a ``.png`` path, a data URI, bytes or a bytes struct is an image; other strings are
    text), then the assistant's answer."""

    def part(p):
        is_image = not isinstance(p, str) or p.endswith(".png") or p.startswith("data:")
        return {"type": "image", "image": p} if is_image else {"type": "text", "text": p}

    return [{"role": "user", "content": [part(p) for p in user_parts]}, {"role": "assistant", "content": answer}]


def reply_texts(messages) -> list[str]:
    """What the loss mask must cover: each (string) reply and its <|im_end|>."""
    return [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]


def alone(processor, images, base_dir=None):
    """What the processor gives for these images by themselves."""
    out = processor(images=[load_image(i, base_dir) for i in images], return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


def check_document(doc, tokenizer, processor, ids, messages, base_dir, masked=None):
    """The numbers of one tokenized conversation: pad runs = the processor's grids, pixel rows = their patches,
    the masked runs = ``masked`` (default: each reply's text and end of turn), never a vision token."""
    images = [p["image"] for m in messages if isinstance(m["content"], list) for p in m["content"] if "image" in p]
    runs = image_runs(doc.input_ids, ids["image_pad"])
    vision = set(ids.values())
    assert all(flag == 0 for token, flag in zip(doc.input_ids, doc.loss_mask, strict=True) if token in vision)
    decoded = [tokenizer.decode(run) for run in masked_runs(doc.input_ids, doc.loss_mask)]
    assert decoded == (reply_texts(messages) if masked is None else masked)
    if not images:
        assert doc.pixel_values is None and doc.image_grid_thw is None and not runs
        return
    pixels, grids = alone(processor, images, base_dir)
    assert torch.equal(doc.image_grid_thw, grids) and doc.image_grid_thw.dtype == torch.int64
    assert torch.equal(doc.pixel_values, pixels.float()) and doc.pixel_values.dtype == torch.float32
    assert doc.pixel_values.shape == (int(grids.prod(-1).sum()), 3 * 2 * 8 * 8)
    assert [end - start for start, end in runs] == (grids.prod(-1) // MERGE**2).tolist()
    assert [(start - 1, end + 1) for start, end in runs] == list(doc.image_spans)
    for start, end in doc.image_spans:
        assert doc.input_ids[start] == ids["vision_start"] and doc.input_ids[end - 1] == ids["vision_end"]


# ---------------------------------------------------------------------------------------------------------
# Shipped assets


def test_tiny_vl_processor_extends_the_tiny_tokenizer(tokenizer, processor, ids):
    base = AutoTokenizer.from_pretrained(tiny_tokenizer_dir())
    vocab, base_vocab = tokenizer.get_vocab(), base.get_vocab()
    assert len(base) == 649 and len(tokenizer) == 653
    assert {t: i for t, i in vocab.items() if i < 649} == base_vocab  # every existing id kept
    assert ids == {"vision_start": 649, "vision_end": 650, "image_pad": 651, "video_pad": 652}
    assert VisionTokens().ids(tokenizer) == ids and VisionTokens().ids(base) == {}
    text = "<|vision_start|><|image_pad|><|image_pad|><|vision_end|>"
    assert tokenizer.encode(text, add_special_tokens=False) == [649, 651, 651, 650]
    messages = conversation(image_path(0), "What?", answer="A.")
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    user = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What?<|im_end|>\n"
    assert rendered == user + "<|im_start|>assistant\nA.<|im_end|>\n"
    prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert prompt == user + "<|im_start|>assistant\n"
    text_only = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    assert tokenizer.apply_chat_template(text_only, tokenize=False) == base.apply_chat_template(
        text_only, tokenize=False
    )
    # The Pillow image processor, as configured, loaded without a warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = [load_processor(tiny_vl_processor_dir())[1]]
        with contextlib.suppress(ImportError):  # 5.17's AutoImageProcessor wants torchvision (load_processor copes)
            loaded.append(AutoImageProcessor.from_pretrained(tiny_vl_processor_dir()))
    for image_processor in loaded:
        assert type(image_processor).__name__ == "Qwen2VLImageProcessorPil"
        assert (image_processor.patch_size, image_processor.temporal_patch_size, image_processor.merge_size) == (
            8,
            2,
            2,
        )
        out = image_processor(images=[Image.new("RGB", (56, 40))], return_tensors="pt")  # 40 px high, 56 wide
        assert out["pixel_values"].shape == (32, 384) and out["image_grid_thw"].tolist() == [[1, 4, 8]]


def test_shipped_vl_chat_is_small_mixed_and_regenerates(shipped):
    assert len(shipped) == 48 and shipped.skipped == 0
    per_message = [
        [sum(p["type"] == "image" for p in m["content"]) if isinstance(m["content"], list) else 0 for m in c.messages]
        for c in shipped
    ]
    images, in_one_turn = [sum(n) for n in per_message], [max(n) for n in per_message]
    assert sum(n == 1 for n in images) > 24  # most have one image
    assert sum(n == 0 for n in images) >= 3  # a few text-only ones
    assert sum(n == 2 for n in in_one_turn) >= 3  # two images in one user turn
    assert sum(n == 2 and m == 1 for n, m in zip(images, in_one_turn, strict=True)) >= 3  # one per turn
    assert sum(sum(m["role"] == "assistant" for m in c.messages) > 1 for c in shipped) >= 6  # multi-turn ones
    pngs = sorted(IMAGES.glob("*.png"))
    assert [p.name for p in pngs] == [f"{i:04d}.png" for i in range(sum(images))]  # each referenced once, in order
    for png in pngs:
        with Image.open(png) as picture:
            w, h = picture.size
            assert min(w, h) >= 24 and max(w, h) <= 64 and w != h
    files = [*tiny_vl_processor_dir().iterdir(), *tiny_vl_chat_path().parent.rglob("*")]
    assert sum(p.stat().st_size for p in files if p.is_file()) < 300_000
    spec = importlib.util.spec_from_file_location("make_tiny_vl_assets", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--check"]) == 0  # seeded: a fresh build is byte-identical to the shipped files


def test_shipped_answers_follow_from_the_pictures(shipped):
    """Spot checks of the generator: dot counts and background colors are what the pictures show."""
    words = ["zero", "one", "two", "three", "four", "five", "six"]
    checked = 0
    for c in shipped:
        for question, answer in zip(c.messages[:-1], c.messages[1:], strict=True):
            content = question["content"]
            if question["role"] != "user" or not isinstance(content, list) or len(content) != 2:
                continue
            (text,) = [p["text"] for p in content if p["type"] == "text"]
            (image,) = [p["image"] for p in content if p["type"] == "image"]
            picture = torch.from_numpy(np.array(load_image(image, IMAGES.parent)))
            if text == "How many dots are there?":
                dots = int((picture == 20).all(-1).sum()) // 16  # 4 x 4 px each
                expected = "There is one dot." if dots == 1 else f"There are {words[dots]} dots."
                assert answer["content"] == expected
                checked += 1
            elif text == "What color is the background?":
                color = "white" if (picture == 245).all(-1).any() else "gray"
                assert answer["content"] == f"The background is {color}."
                checked += 1
    assert checked >= 8


# ---------------------------------------------------------------------------------------------------------
# Tokenizing


def test_every_shipped_conversation_expands_to_its_grids(tokenizer, processor, ids, shipped):
    base_dir = tiny_vl_chat_path().parent
    for c in shipped:
        doc = tokenize_conversation(tokenizer, c.messages, image_processor=processor, base_dir=base_dir)
        check_document(doc, tokenizer, processor, ids, c.messages, base_dir)
        ids_list, mask = doc  # unpacks like the text-only pair
        assert ids_list is doc.input_ids and mask is doc.loss_mask


def test_two_images_in_a_turn_and_images_in_a_reply_carry_no_loss(tokenizer, processor, ids):
    messages = [
        {"role": "system", "content": "Look closely."},
        *conversation(image_path(0), "Compare", image_path(1), "please.", answer="The first is larger."),
        {"role": "user", "content": [{"type": "text", "text": "Show me again."}]},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Here:"},
                {"type": "image", "image": image_path(2)},
                {"type": "text", "text": "and here:"},
                {"type": "image", "image": image_path(3)},
            ],
        },
    ]
    doc = tokenize_conversation(tokenizer, messages, image_processor=processor)
    # Loss on the reply text around the reply's images (and its end of turn), never on their tokens.
    masked = ["The first is larger.<|im_end|>", "Here:", "and here:", "<|im_end|>"]
    check_document(doc, tokenizer, processor, ids, messages, None, masked)
    assert len(doc.image_spans) == 4
    # The pixel rows of each image are the processor's for it alone, in order.
    rows = torch.split(doc.pixel_values, doc.image_grid_thw.prod(-1).tolist())
    for k, block in enumerate(rows):
        torch.testing.assert_close(block, alone(processor, [image_path(k)])[0].float(), rtol=0, atol=0)


def test_vision_tokens_can_be_renamed(processor):
    """Another tokenizer's spelling of the placeholders, through ``vision_tokens``."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir())
    tokenizer.add_special_tokens({"additional_special_tokens": ["<img>", "<img_start>", "<img_end>"]})
    tokenizer.chat_template = (
        "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' }}{%- if m['content'] is string %}"
        "{{- m['content'] }}{%- else %}{%- for p in m['content'] %}{%- if p['type'] == 'image' %}"
        "{{- '<img_start><img><img_end>' }}{%- else %}{{- p['text'] }}{%- endif %}{%- endfor %}{%- endif %}"
        "{{- '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    tokens = VisionTokens(image_pad="<img>", vision_start="<img_start>", vision_end="<img_end>", video_pad="<vid>")
    pad, start, end = tokenizer.convert_tokens_to_ids(["<img>", "<img_start>", "<img_end>"])
    doc = tokenize_conversation(tokenizer, conversation(image_path(4)), image_processor=processor, vision_tokens=tokens)
    (first, last), grid = doc.image_spans[0], doc.image_grid_thw[0]
    assert doc.input_ids[first] == start and doc.input_ids[last - 1] == end
    assert doc.input_ids[first + 1 : last - 1] == [pad] * (int(grid.prod()) // MERGE**2)
    with pytest.raises(ValueError, match="text holds the image placeholder token '<img>'"):
        tokenize_conversation(tokenizer, conversation("<img>"), image_processor=processor, vision_tokens=tokens)


# ---------------------------------------------------------------------------------------------------------
# Packing


def test_packing_keeps_images_with_their_documents(tokenizer, processor, ids, shipped):
    base_dir = tiny_vl_chat_path().parent
    docs = [tokenize_conversation(tokenizer, c.messages, image_processor=processor, base_dir=base_dir) for c in shipped]
    order = list(range(len(docs)))
    random.Random(3).shuffle(order)  # the packing order (documented: shuffled with random.Random(seed))
    following = iter(docs[k] for k in order)
    dataset = PackedDataset.build(tiny_vl_chat_path(), tokenizer, 160, image_processor=processor, seed=3)
    assert dataset.stats.documents == 48 and dataset.stats.truncated == 0 and len(dataset) > 1
    mixed = seen = 0
    for i in range(len(dataset)):
        row = dataset[i]
        tokens = row.input_ids.tolist()
        row_docs = [next(following) for _ in range(row.num_documents)]
        assert tokens[: sum(row.seq_lens[: row.num_documents])] == [t for d in row_docs for t in d.input_ids]
        with_images = [d for d in row_docs if d.image_grid_thw is not None]
        runs = image_runs(tokens, ids["image_pad"])
        labels = row.labels[row.labels != IGNORE_INDEX].tolist()
        assert not set(labels) & set(ids.values())  # no loss on a vision token
        if not with_images:
            assert row.pixel_values is None and row.image_grid_thw is None and not runs
            continue
        grids = row.image_grid_thw
        assert len(runs) == len(grids) == sum(len(d.image_spans) for d in row_docs)
        assert [e - s for s, e in runs] == (grids.prod(-1) // MERGE**2).tolist()
        assert row.pixel_values.shape[0] == int(grids.prod(-1).sum())
        assert torch.equal(row.pixel_values, torch.cat([d.pixel_values for d in with_images]))  # in document order
        assert torch.equal(grids, torch.cat([d.image_grid_thw for d in with_images]))
        mixed += len(with_images) < len(row_docs)
        seen += len(row_docs)
    assert mixed >= 1  # some row mixes documents with and without images
    assert seen > 30
    with pytest.raises(ValueError, match=r"collate_packed stacks text rows only; rows \[0\] have images"):
        collate_packed([next(dataset[i] for i in range(len(dataset)) if dataset[i].pixel_values is not None)])
    text_row = pack_examples([([1, 2, 3], [0, 1, 1])], 4, pad_token_id=0).rows[0]
    assert collate_packed([text_row])["input_ids"].shape == (1, 4)
    copy = pickle.loads(pickle.dumps(dataset))  # what broadcast_object_list sends
    for i in range(len(dataset)):
        assert copy[i].keys() == dataset[i].keys() and torch.equal(copy[i].input_ids, dataset[i].input_ids)
        for key in ("pixel_values", "image_grid_thw"):
            a, b = copy[i][key], dataset[i][key]
            assert (a is None and b is None) or torch.equal(a, b)
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    text_only = PackedDataset.from_messages([chat], tokenizer, 16)
    assert text_only._pixel_values is None  # text-only datasets hold no per-row image lists
    assert text_only[0].as_dict()["pixel_values"] is None and text_only[0]["image_grid_thw"] is None


def test_truncation_never_cuts_an_image(tokenizer, processor, ids):
    doc = tokenize_conversation(
        tokenizer, conversation(image_path(2), "Compare.", image_path(3)), image_processor=processor
    )
    (first_start, first_end), (second_start, second_end) = doc.image_spans
    first_rows = int(doc.image_grid_thw[0].prod())

    def pack(seq_len):
        rows, stats = pack_examples([doc], seq_len, pad_token_id=0)
        return rows[0], stats

    for seq_len in (second_start + 1, (second_start + second_end) // 2, second_end - 1):  # through the second
        row, stats = pack(seq_len)
        assert stats.truncated == 1 and row.seq_lens[0] == second_start  # cut right before its vision start
        assert row.image_grid_thw.tolist() == doc.image_grid_thw[:1].tolist()
        assert torch.equal(row.pixel_values, doc.pixel_values[:first_rows])
        assert len(image_runs(row.input_ids.tolist(), ids["image_pad"])) == 1
    row, stats = pack(second_end)  # both fit whole; the reply is cut
    assert stats.truncated == 1 and row.seq_lens == (second_end,) and torch.equal(row.pixel_values, doc.pixel_values)
    row, stats = pack(first_start + 2)  # through the first: no image left
    assert row.image_grid_thw is None and row.pixel_values is None and row.seq_lens[0] == first_start
    assert ids["image_pad"] not in row.input_ids.tolist()
    row, stats = pack(first_end)  # the first exactly
    assert row.seq_lens == (first_end,) and len(row.image_grid_thw) == 1
    rows, stats = pack_examples([doc], len(doc.input_ids) - 1, pad_token_id=0, overlong="drop")
    assert stats.dropped == 1 and not rows
    lost = TokenizedConversation(
        doc.input_ids, doc.loss_mask, doc.pixel_values[1:], doc.image_grid_thw, doc.image_spans
    )
    with pytest.raises(ValueError, match=r"example 0: \d+ pixel rows for grids"):
        pack_examples([lost], 512, pad_token_id=0)
    with pytest.raises(ValueError, match=r"image_spans .* go together"):
        pack_examples([TokenizedConversation(doc.input_ids, doc.loss_mask, doc.pixel_values)], 512, pad_token_id=0)


def test_build_training_rows_passes_the_image_processor(tokenizer, processor):
    data = SimpleNamespace(path=str(tiny_vl_chat_path()), seq_len=128, seed=0, overlong="truncate", on_error="raise")
    rows, stats = build_training_rows(SimpleNamespace(data=data), tokenizer, image_processor=processor)
    assert stats.documents == 48 and len(rows) == stats.rows
    assert sum(len(r.image_grid_thw) for r in rows if r.image_grid_thw is not None) == len(list(IMAGES.glob("*.png")))
    with pytest.raises(DataError, match=r"no image processor is set: train a Qwen3\.5-VL model"):
        build_training_rows(SimpleNamespace(data=data), tokenizer)


def _build_vl_in_group(topology, data: str):
    tokenizer, processor = load_processor(tiny_vl_processor_dir())
    path = data if topology.rank == 0 else data + ".not-read-on-this-rank"
    dataset = PackedDataset.build(path, tokenizer, 128, image_processor=processor, group=topology.group)
    return [dataset[i].as_dict() for i in range(len(dataset))]


def test_rank_zero_broadcasts_rows_with_images(tmp_path):
    shutil.copytree(IMAGES, tmp_path / "images")
    lines = tiny_vl_chat_path().read_text().splitlines()[:10]
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    with GlooWorkers(world_size=2) as workers:
        rows0, rows1 = workers.run(_build_vl_in_group, str(tmp_path / "d.jsonl"))
    assert len(rows0) == len(rows1) and any(r["pixel_values"] is not None for r in rows0)
    for a, b in zip(rows0, rows1, strict=True):
        for key, value in a.items():
            other = b[key]
            assert (value is None and other is None) or (
                torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other
            )


# ---------------------------------------------------------------------------------------------------------
# Other image sources


def test_parquet_bytes_structs_paths_and_data_uris(tmp_path, tokenizer, processor):
    shutil.copy(image_path(4), tmp_path / "pic.png")
    blob = (tmp_path / "pic.png").read_bytes()
    reference = tokenize_conversation(tokenizer, conversation(image_path(4)), image_processor=processor)
    uri = "data:image/png;base64," + base64.b64encode(blob).decode()
    for image in (uri, blob, {"bytes": blob, "path": None}, {"bytes": None, "path": str(tmp_path / "pic.png")}):
        doc = tokenize_conversation(tokenizer, conversation(image), image_processor=processor)
        assert doc.input_ids == reference.input_ids and torch.equal(doc.pixel_values, reference.pixel_values)
    # Parquet as HF datasets write it: every content a list of parts, None in the fields a part lacks.
    for name, image in (
        ("bytes", blob),
        ("struct", {"bytes": blob, "path": "x.png"}),
        ("path", {"bytes": None, "path": "pic.png"}),
    ):
        messages = conversation(image, "What is it?", image)
        messages[1]["content"] = [{"type": "text", "text": messages[1]["content"]}]
        pq.write_table(pa.Table.from_pylist([{"messages": messages}] * 2), tmp_path / f"{name}.parquet")
        loaded = load_conversations(tmp_path / f"{name}.parquet")
        assert loaded[0].messages[0]["content"][1] == {"type": "text", "text": "What is it?"}  # None fields dropped
        dataset = PackedDataset.build(tmp_path / f"{name}.parquet", tokenizer, 128, image_processor=processor)
        assert dataset.stats.documents == 2 and len(dataset[0].image_grid_thw) == 4  # two documents, two images each
        torch.testing.assert_close(dataset[0].pixel_values, reference.pixel_values.repeat(4, 1), rtol=0, atol=0)


def test_image_paths_resolve_next_to_the_data_file(tmp_path, tokenizer, processor, monkeypatch):
    (tmp_path / "data" / "pics").mkdir(parents=True)
    shutil.copy(image_path(5), tmp_path / "data" / "pics" / "a.png")
    data = tmp_path / "data" / "d.jsonl"
    data.write_text(json.dumps({"messages": conversation("pics/a.png", "What?")}) + "\n")
    monkeypatch.chdir(tmp_path)  # not the data folder
    dataset = PackedDataset.build(data, tokenizer, 128, image_processor=processor)
    reference = tokenize_conversation(tokenizer, conversation(image_path(5), "What?"), image_processor=processor)
    assert torch.equal(dataset[0].pixel_values, reference.pixel_values)
    in_memory = PackedDataset.from_messages(
        [conversation("pics/a.png", "What?")], tokenizer, 128, image_processor=processor, base_dir=tmp_path / "data"
    )
    assert torch.equal(in_memory[0].pixel_values, reference.pixel_values)


def test_image_paths_may_not_leave_the_data_folder(tmp_path, tokenizer, processor):
    """Absolute paths and '..' (or a symlink) leading out of the data file's folder are refused naming the row,
    unless image_paths_outside allows them; the same picture inside the folder loads."""
    (tmp_path / "data").mkdir()
    shutil.copy(image_path(5), tmp_path / "outside.png")
    (tmp_path / "data" / "link.png").symlink_to(tmp_path / "outside.png")
    for given in (str(tmp_path / "outside.png"), "../outside.png", "link.png"):
        data = _jsonl(tmp_path / "data" / "d.jsonl", conversation(given, "What?"))
        with pytest.raises(DataError, match=r"d\.jsonl: row 1: .*image path .* leads outside the dataset's folder"):
            PackedDataset.build(data, tokenizer, 128, image_processor=processor)
        dataset = PackedDataset.build(data, tokenizer, 128, image_processor=processor, image_paths_outside=True)
        assert dataset.stats.documents == 1 and len(dataset[0].image_grid_thw) == 1


# ---------------------------------------------------------------------------------------------------------
# Errors


def _jsonl(path: Path, *conversations) -> Path:
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    return path


def _tokenizer_with_template(tmp_path: Path, tokenizer, image_markup: str):
    """A copy of the tiny VL tokenizer whose template renders each image part as ``image_markup``."""
    folder = tmp_path / f"tok{abs(hash(image_markup))}"
    tokenizer.save_pretrained(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' }}{%- if m['content'] is string %}"
        "{{- m['content'] }}{%- else %}{%- for p in m['content'] %}{%- if p['type'] == 'text' %}{{- p['text'] }}"
        "{%- else %}{{- '" + image_markup + "' }}{%- endif %}{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}"
        "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    return AutoTokenizer.from_pretrained(folder)


def test_sixteen_bit_images_scale_to_eight_bits_and_odd_sources_are_named(tmp_path):
    """Pillow's own conversion clips a 16-bit image above 255 (nearly all white); it is scaled instead. A folder,
    a name too long for the file system, text where bytes go, and bytes that are no image are each named."""
    wide = np.linspace(0, 65535, 64 * 64).reshape(64, 64).astype(np.uint16)
    buffer = io.BytesIO()
    Image.fromarray(wide).save(buffer, format="PNG")
    rgb = np.asarray(load_image(buffer.getvalue()))
    assert rgb.shape == (64, 64, 3) and (rgb[..., 0] == np.rint(wide / 257.0)).all()
    (tmp_path / "a.png").mkdir()
    with pytest.raises(ValueError, match=r"image file '.*a\.png' is a folder"):
        load_image("a.png", tmp_path)
    with pytest.raises(ValueError, match="File name too long"):
        load_image("a" * 300 + ".png", tmp_path)
    with pytest.raises(ValueError, match=r"'bytes' must be raw bytes, not text; in JSON give the image as a 'data:"):
        load_image({"bytes": "iVBORw0KGgo=", "path": None})
    with pytest.raises(ValueError, match=r"^cannot decode image of 5 bytes: not an image format Pillow reads$"):
        load_image(b"plain")


def test_row_errors_name_file_row_and_image_or_are_skipped(tmp_path, tokenizer, processor):
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    shutil.copy(image_path(0), tmp_path / "good.png")  # images inside the data file's folder
    shutil.copy(image_path(1), tmp_path / "other.png")
    good = conversation("good.png")
    garbage = "data:image/png;base64," + base64.b64encode(b"not an image").decode()
    cases = [
        (
            conversation("nope.png"),
            r"d\.jsonl: row 2: messages\[0\]\.content\[0\]: image file '.*nope\.png' does not exist",
        ),
        (
            conversation("Look", "broken.png"),
            r"row 2: messages\[0\]\.content\[1\]: cannot decode image file '.*broken\.png'",
        ),
        (conversation(garbage), r"row 2: messages\[0\]\.content\[0\]: cannot decode image of 12 bytes"),
        (conversation("data:image/png,abc"), r"row 2: .*only data:image/\.\.\.;base64,<data> URIs are read"),
        (conversation("https://example.com/a.png"), "row 2: .*URLs are not fetched"),
        (
            conversation("Look: <|image_pad|>"),
            r"row 2: messages\[0\] \(user\) text holds the image placeholder token '<\|image_pad\|>'",
        ),
        (
            conversation("other.png", answer="<|vision_end|>"),
            r"row 2: messages\[1\] \(assistant\) text holds .*<\|vision_end\|>",
        ),
    ]
    for bad, pattern in cases:
        data = _jsonl(tmp_path / "d.jsonl", good, bad)
        with pytest.raises(DataError, match=pattern):
            PackedDataset.build(data, tokenizer, 128, image_processor=processor)
        skipped = PackedDataset.build(data, tokenizer, 128, image_processor=processor, on_error="skip")
        assert skipped.stats.documents == 1 and skipped.stats.skipped_malformed == 1


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ([{"type": "video", "video": "v.mp4"}], "videos are not supported"),
        ([{"type": "audio", "audio": "a.wav"}], r"unknown content part \{'type': 'audio', 'audio': 'a\.wav'\}"),
        ([{"type": "text"}], "a text part needs a string 'text', got NoneType"),
        ([{"type": "image"}], r"an image part needs 'image': .*got None"),
        ([{"type": "image", "image": {"bytes": None, "path": None}}], r"an image part needs 'image'"),
        ([{"type": "image", "image": ""}], r"an image part needs 'image'"),
        ("hi", None),
    ],
)
def test_malformed_parts_are_refused_when_loading(tmp_path, content, problem):
    data = _jsonl(tmp_path / "p.jsonl", [{"role": "user", "content": content}, {"role": "assistant", "content": "x"}])
    if problem is None:
        assert len(load_conversations(data)) == 1
        return
    with pytest.raises(DataError, match=r"p\.jsonl: row 1: messages\[0\]\.content\[0\]: " + problem):
        load_conversations(data)
    assert load_conversations(data, on_error="skip").skipped == 1


def test_templates_that_drop_or_miscount_images_are_refused(tmp_path, tokenizer, processor):
    messages = conversation(image_path(0), "and", image_path(1))
    dropping = _tokenizer_with_template(tmp_path, tokenizer, "")
    with pytest.raises(
        ValueError, match=r"images without tokens: the chat template rendered 0 <\|image_pad\|> .*for 2"
    ):
        tokenize_conversation(dropping, messages, image_processor=processor)
    doubling = _tokenizer_with_template(tmp_path, tokenizer, "<|vision_start|><|image_pad|><|image_pad|><|vision_end|>")
    with pytest.raises(
        ValueError, match=r"image-token counts that do not match grids: image 0 .* has 2 <\|image_pad\|>"
    ):
        tokenize_conversation(doubling, messages, image_processor=processor)
    twice = _tokenizer_with_template(tmp_path, tokenizer, "<|vision_start|><|image_pad|><|vision_end|>" * 2)
    with pytest.raises(ValueError, match=r"image tokens without images: the chat template rendered 4 .* for 2"):
        tokenize_conversation(twice, messages, image_processor=processor)
    glued = _tokenizer_with_template(tmp_path, tokenizer, "<|image_pad|>")  # two adjacent images: one run
    with pytest.raises(ValueError, match="images without tokens: the chat template rendered 1"):
        tokenize_conversation(glued, conversation(image_path(0), image_path(1)), image_processor=processor)
    # Through the dataset: the file and row are named, and on_error="skip" counts it.
    data = _jsonl(tmp_path / "d.jsonl", messages)
    with pytest.raises(DataError, match=r"d\.jsonl: row 1: images without tokens"):
        PackedDataset.build(data, dropping, 128, image_processor=processor)
    with pytest.raises(DataError, match="no packed rows"):
        PackedDataset.build(data, dropping, 128, image_processor=processor, on_error="skip")


def test_images_need_a_processor_and_a_vl_tokenizer(tmp_path, tokenizer, processor):
    messages = conversation(image_path(0))
    with pytest.raises(ValueError, match=r"1 image\(s\) but no image processor is set: train a Qwen3\.5-VL model"):
        tokenize_conversation(tokenizer, messages)
    data = _jsonl(tmp_path / "d.jsonl", messages)
    with pytest.raises(DataError, match=r"row 1: the conversation has 1 image\(s\) but no image processor"):
        PackedDataset.build(data, tokenizer, 128)
    text_tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir())
    with pytest.raises(ValueError, match=r"the tokenizer has no '<\|image_pad\|>' token"):
        tokenize_conversation(text_tokenizer, messages, image_processor=processor)
    with pytest.raises(FileNotFoundError, match=r"no preprocessor_config\.json"):
        load_processor(tiny_tokenizer_dir())
