"""The token store and its rows: cache keys and reuse, rebuilding a broken cache, parallel = serial tokenization,
best-fit-decreasing packing, rows equal to the in-memory pipeline's documents, identical rows on every rank, and
lazily processed images equal to eagerly processed ones."""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from cp_core.testing import GlooWorkers, RankFailure
from sft_trainer.data import (
    IGNORE_INDEX,
    DataError,
    load_conversations,
    load_processor,
    pack_examples,
    tiny_chat_path,
    tiny_tokenizer_dir,
    tiny_vl_chat_path,
    tiny_vl_processor_dir,
    tokenize_conversation,
)
from sft_trainer.data import store as data_store
from sft_trainer.data import tokenize as data_tokenize
from sft_trainer.data.pack_plan import best_fit_decreasing, plan_key
from sft_trainer.data.rows import open_packed_store, open_packed_store_distributed, open_token_store

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir())


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> Path:
    """1,200 conversations of the benchmark's generator (about 1.5M tokens, 3 MB) plus two malformed lines."""
    spec = importlib.util.spec_from_file_location("make_chat_data", REPO / "benchmarks" / "make_chat_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    path = module.write(tmp_path_factory.mktemp("gen") / "chat.jsonl", 1200, seed=1)
    lines = path.read_text().splitlines()
    lines.insert(700, "{oops")
    lines.insert(1000, json.dumps({"messages": [{"role": "user", "content": "no reply"}]}))
    path.write_text("\n".join(lines) + "\n")
    return path


def _arrays(store: data_store.TokenStore) -> dict[str, np.ndarray]:
    return {name: np.array(array) for name, array in store.arrays.items()}  # copies: stores get replaced


def test_key_changes_with_every_input_and_the_store_is_reused_otherwise(tmp_path, tokenizer):
    data = tmp_path / "chats.jsonl"
    shutil.copy(tiny_chat_path(), data)
    options = data_tokenize.options_for_key(
        data_tokenize.token_options(end_of_turn=None, chat_template_kwargs=None, vision_tokens=None, on_error="raise")
    )

    def key(tok=tokenizer, processor=None, **changes):
        return data_store.token_key([data], tok, image_processor=processor, options={**options, **changes})[0]

    base = key()
    assert key() == base
    assert len({base, key(end_of_turn="</s>"), key(on_error="skip"), key(chat_template_kwargs={"x": 1})}) == 4
    other_template = AutoTokenizer.from_pretrained(tiny_tokenizer_dir())
    other_template.chat_template = other_template.chat_template.replace("\\n", "\\n\\n", 1)
    assert key(other_template) != base
    vl_tokenizer, processor = load_processor(tiny_vl_processor_dir())
    with_processor = key(vl_tokenizer, processor)
    processor.image_mean = (0.4, 0.5, 0.5)
    assert key(vl_tokenizer, processor) != with_processor
    stat = data.stat()
    text = data.read_bytes()
    data.write_bytes(text.replace(b"a", b"b", 1))  # same size: the content decides
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert key() != base  # no memo: hashed again
    memo: dict = {}
    changed = data_store.token_key([data], tokenizer, options=options, memo=memo)[0]
    assert memo and data_store.token_key([data], tokenizer, options=options, memo=memo)[0] == changed
    data.write_bytes(text)
    # Through the cache: reused when nothing changed, a new store when the data did; packing options key the plan.
    logs: list[str] = []
    first = open_token_store(data, tokenizer, cache_dir=tmp_path / "cache", num_proc=1, log=logs.append)
    again = open_token_store(data, tokenizer, cache_dir=tmp_path / "cache", num_proc=1, log=logs.append)
    assert first.path == again.path and logs[0].startswith("data cache: building") and "reusing" in logs[-1]
    data.write_bytes(
        text
        + json.dumps({"messages": [{"role": "user", "content": "y"}, {"role": "assistant", "content": "x"}]}).encode()
        + b"\n"
    )
    changed_store = open_token_store(data, tokenizer, cache_dir=tmp_path / "cache", num_proc=1, log=logs.append)
    assert changed_store.path != first.path and changed_store.num_documents == first.num_documents + 1
    assert (
        len(
            {
                plan_key(256, "truncate", 0),
                plan_key(512, "truncate", 0),
                plan_key(256, "drop", 0),
                plan_key(256, "truncate", 1),
            }
        )
        == 4
    )


def test_broken_or_partial_cache_is_rebuilt(tmp_path, tokenizer):
    cache = tmp_path / "cache"
    logs: list[str] = []
    store = open_token_store(tiny_chat_path(), tokenizer, cache_dir=cache, num_proc=1, log=logs.append)
    expected = _arrays(store)
    (cache / ".tokens-leftover.tmp-1-abc").mkdir()  # a crashed build's temporary folder is never read
    np.save(tmp_path / "short.npy", expected["tokens"][:-5])
    os.replace(
        tmp_path / "short.npy", store.path / "tokens.npy"
    )  # a cut-short array (a new file: `store` maps the old)
    rebuilt = open_token_store(tiny_chat_path(), tokenizer, cache_dir=cache, num_proc=1, log=logs.append)
    assert "incomplete" in logs[-2] and "tokens.npy" in logs[-2] and logs[-1].startswith("data cache: built")
    assert all(np.array_equal(expected[k], v) for k, v in _arrays(rebuilt).items())
    (rebuilt.path / "manifest.json").unlink()  # arrays without the manifest that marks them complete
    open_token_store(tiny_chat_path(), tokenizer, cache_dir=cache, num_proc=1, log=logs.append)
    assert "incomplete" in logs[-2] and "manifest.json" in logs[-2]
    assert len(list(cache.glob(".tokens-*.broken-*"))) == 2 and len(list(cache.glob("tokens-*"))) == 1
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    with pytest.raises(DataError, match=r"a-file/cache cannot be created .*; set data\.cache_dir"):
        open_token_store(tiny_chat_path(), tokenizer, cache_dir=blocked / "cache")
    plan_dir = open_packed_store(tiny_chat_path(), tokenizer, 128, cache_dir=cache).plan.path
    (plan_dir / "row_docs.npy").write_bytes(b"not an array")
    assert open_packed_store(tiny_chat_path(), tokenizer, 128, cache_dir=cache).stats.documents == 400


def test_parallel_tokenization_equals_serial_and_numbers_rows(tmp_path, tokenizer, generated, monkeypatch):
    monkeypatch.setattr(data_tokenize, "_MIN_CHUNK_BYTES", 200_000)  # several chunks, cut inside the file
    assert len(data_tokenize.plan_chunks([generated], 2)) >= 4
    serial = open_token_store(generated, tokenizer, cache_dir=tmp_path / "a", num_proc=1, on_error="skip")
    parallel = open_token_store(generated, tokenizer, cache_dir=tmp_path / "b", num_proc=2, on_error="skip")
    assert parallel.manifest["build"]["processes"] == 2 and serial.manifest["build"]["processes"] == 1
    a, b = _arrays(serial), _arrays(parallel)
    assert all(np.array_equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    assert serial.manifest["skipped"] == parallel.manifest["skipped"] == 2
    assert [m.split(": ", 2)[1] for m in parallel.manifest["skip_reasons"]] == ["row 701", "row 1001"]
    loaded = load_conversations(generated, on_error="skip")
    assert a["doc_row"].tolist() == [c.row_number for c in loaded]
    for d in (0, 333, 699, 1199):  # the documents are the in-memory tokenizer's, with their loss masks
        doc = tokenize_conversation(tokenizer, loaded[d].messages)
        start, end = a["doc_offsets"][d], a["doc_offsets"][d + 1]
        assert a["tokens"][start:end].tolist() == doc.input_ids and a["loss_mask"][start:end].tolist() == doc.loss_mask
        assert a["doc_loss"][d] == sum(doc.loss_mask[1:])
    with pytest.raises(DataError, match=r"chat\.jsonl: row 701: invalid JSON"):  # the first bad row, in file order
        open_token_store(generated, tokenizer, cache_dir=tmp_path / "c", num_proc=2)
    assert not list((tmp_path / "c").glob("tokens-*")) and not list((tmp_path / "c").glob(".tokens-*"))


def test_best_fit_decreasing_fills_rows_and_is_deterministic(tmp_path, tokenizer, generated):
    rng = np.random.default_rng(0)
    lengths = np.minimum(8192, np.exp(rng.normal(7.0, 0.7, 20_000))).astype(np.int32)
    offsets, docs = best_fit_decreasing(lengths, 8192, seed=3)
    assert sorted(docs.tolist()) == list(range(len(lengths)))  # every document once, never split
    filled = np.add.reduceat(lengths[docs], offsets[:-1])
    assert filled.max() <= 8192 and 1 - filled.sum() / (len(filled) * 8192) < 0.002
    again = best_fit_decreasing(lengths, 8192, seed=3)
    other = best_fit_decreasing(lengths, 8192, seed=4)
    assert np.array_equal(again[1], docs) and not np.array_equal(other[1], docs)
    dataset = open_packed_store(generated, tokenizer, 8192, cache_dir=tmp_path / "cache", on_error="skip", num_proc=1)
    stats = dataset.stats
    assert stats.documents == 1200 and stats.padding_tokens / (stats.rows * 8192) < 0.01
    assert dataset.efficiency == 1 - stats.padding_tokens / (stats.rows * 8192)
    loaded = load_conversations(generated, on_error="skip")
    docs_in_memory = [tokenize_conversation(tokenizer, c.messages) for c in loaded]
    greedy = pack_examples(docs_in_memory, 8192, pad_token_id=dataset.pad_token_id).stats
    assert greedy.loss_tokens == stats.loss_tokens and greedy.truncated == stats.truncated
    assert greedy.padding_tokens > 3 * stats.padding_tokens  # shuffled greedy order wastes more


def _doc_ranges(seq_lens):
    start = 0
    for n in seq_lens:
        yield start, start + n
        start += n


def test_store_rows_hold_the_documents_with_exact_labels(tmp_path, tokenizer):
    dataset = open_packed_store(tiny_chat_path(), tokenizer, 128, seed=5, cache_dir=tmp_path)
    docs = {}
    for c in load_conversations(tiny_chat_path()):
        doc = tokenize_conversation(tokenizer, c.messages)
        docs[tuple(doc.input_ids)] = doc
    seen = 0
    for i in range(len(dataset)):
        row = dataset[i]
        assert row.input_ids.shape == row.labels.shape == (128,) and sum(row.seq_lens) == 128
        assert row.input_ids.dtype == row.labels.dtype == torch.int64
        for start, end in _doc_ranges(row.seq_lens[: row.num_documents]):
            doc = docs[tuple(row.input_ids[start:end].tolist())]
            expected = [t if f else IGNORE_INDEX for t, f in zip(doc.input_ids[1:], doc.loss_mask[1:], strict=True)]
            assert row.labels[start:end].tolist() == [*expected, IGNORE_INDEX]
            seen += 1
        assert (row.labels[128 - row.padding :] == IGNORE_INDEX).all()
    assert seen == 400 == dataset.stats.documents
    assert sum(dataset[i].num_loss_tokens for i in range(len(dataset))) == dataset.stats.loss_tokens
    assert sum(dataset[i].padding for i in range(len(dataset))) == dataset.stats.padding_tokens
    with pytest.raises(IndexError):
        dataset[len(dataset)]
    copy = pickle.loads(pickle.dumps(dataset))  # what a DataLoader worker receives: the paths, mapped again
    assert len(pickle.dumps(dataset)) < 4096 and torch.equal(copy[3].labels, dataset[3].labels)
    truncated = open_packed_store(tiny_chat_path(), tokenizer, 32, cache_dir=tmp_path, overlong="drop")
    assert truncated.stats.dropped > 0 and truncated.stats.documents == 400 - truncated.stats.dropped


def _open_on_rank(topology, data: str, cache: str, vl: bool):
    if vl:
        tokenizer, processor = load_processor(tiny_vl_processor_dir())
    else:
        tokenizer, processor = AutoTokenizer.from_pretrained(tiny_tokenizer_dir()), None
    path = data if topology.rank == 0 else data + ".not-read-on-this-rank"  # one process per node reads
    return _rows_on_rank(path, tokenizer, processor, cache)


def _rows_on_rank(path: str, tokenizer, processor, cache: str):
    dataset = open_packed_store_distributed(
        path, tokenizer, 128, seed=2, cache_dir=cache, image_processor=processor, num_proc=1
    )
    return dataset.stats, [dataset[i].as_dict() for i in range(len(dataset))]


def _open_warm_on_rank(topology, data: str, cache: str):
    """Both ranks find the complete store: they open it without a process group of its own."""
    import torch.distributed as dist

    new_group = dist.new_group

    def refuse(*args, **kwargs):
        raise AssertionError("a warm start created a process group")

    dist.new_group = refuse
    try:
        return _rows_on_rank(data, AutoTokenizer.from_pretrained(tiny_tokenizer_dir()), None, cache)
    finally:
        dist.new_group = new_group


def test_one_rank_builds_and_every_rank_reads_the_same_rows(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(tiny_chat_path().read_text().splitlines()[0] + "\n{oops\n")
    with GlooWorkers(world_size=2) as workers:
        (stats0, rows0), (stats1, rows1) = workers.run(_open_on_rank, str(tiny_chat_path()), str(tmp_path), False)
        vl0, vl1 = workers.run(_open_on_rank, str(tiny_vl_chat_path()), str(tmp_path), True)
        failures = workers.run_collect(_open_on_rank, str(bad), str(tmp_path), False)
        (warm0, wrows0), (warm1, wrows1) = workers.run(_open_warm_on_rank, str(tiny_chat_path()), str(tmp_path))
    assert stats0 == stats1 == warm0 == warm1 and stats0.documents == 400 and len(rows0) == len(rows1) == stats0.rows
    for a, b in zip(rows0 + vl0[1] + wrows0 + wrows1, rows1 + vl1[1] + rows0 + rows0, strict=True):
        for key, value in a.items():
            other = b[key]
            assert (value is None and other is None) or (
                torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other
            )
    assert any(r["pixel_values"] is not None for r in vl0[1])
    assert [type(f).__name__ for f in failures] == ["RankFailure", "RankFailure"]
    assert all(isinstance(f, RankFailure) and "bad.jsonl: row 2: invalid JSON" in f.message for f in failures)


def test_lazy_images_equal_eager_ones(tmp_path):
    tokenizer, processor = load_processor(tiny_vl_processor_dir())
    data = tmp_path / "vl"
    shutil.copytree(tiny_vl_chat_path().parent, data)
    dataset = open_packed_store(
        data / "data.jsonl", tokenizer, 160, seed=3, cache_dir=tmp_path / "c", image_processor=processor
    )
    eager = [
        tokenize_conversation(tokenizer, c.messages, image_processor=processor, base_dir=data)
        for c in load_conversations(data / "data.jsonl")
    ]  # the store's documents are the conversations in file order
    plan, images = dataset.plan, 0
    assert dataset.stats.truncated == 0
    for i in range(len(dataset)):
        row = dataset[i]
        docs = [eager[d] for d in plan.row_docs[plan.row_offsets[i] : plan.row_offsets[i + 1]].tolist()]
        assert row.input_ids[: sum(row.seq_lens[: row.num_documents])].tolist() == [
            t for d in docs for t in d.input_ids
        ]
        with_images = [d for d in docs if d.image_grid_thw is not None]
        if not with_images:
            assert row.pixel_values is None and row.image_grid_thw is None
            continue
        assert torch.equal(row.pixel_values, torch.cat([d.pixel_values for d in with_images]))
        assert torch.equal(row.image_grid_thw, torch.cat([d.image_grid_thw for d in with_images]))
        images += len(row.image_grid_thw)
    assert images == len(list((data / "images").glob("*.png"))) == dataset.store.arrays["image_grid"].shape[0]
    arrays = dataset.store.arrays
    owner = int(np.searchsorted(arrays["image_offsets"], 0, side="right")) - 1  # the document of image 0
    ref = dataset.store.image_ref(0)
    picture = data / ref
    picture.write_bytes(picture.read_bytes() + b"\0")  # edited after the cache was built
    row = next(i for i in range(len(dataset)) if owner in plan.row_docs[plan.row_offsets[i] : plan.row_offsets[i + 1]])
    with pytest.raises(DataError, match=rf"data\.jsonl: row {arrays['doc_row'][owner]}: image '{ref}' changed after"):
        dataset[row]


def test_plan_states_the_packing_efficiency_from_the_cache(tmp_path, tokenizer, capsys):
    from sft_trainer.cli import plan_main

    args = ["--data.cache_dir", str(tmp_path), "--data.seq_len", "256"]
    assert plan_main(args)["data"]["cached"] is False
    assert "packing efficiency known once the token cache is built" in capsys.readouterr().out
    dataset = open_packed_store(tiny_chat_path(), tokenizer, 256, cache_dir=tmp_path, num_proc=1)
    data = plan_main(args)["data"]
    assert data["cached"] and data["efficiency"] == dataset.efficiency and data["rows"] == len(dataset)
    assert f"packing efficiency {dataset.efficiency:.2%}" in capsys.readouterr().out


@pytest.mark.parametrize("batch_chars", [1, 1 << 30])  # a tokenizer call per row, or one for the whole file
def test_batched_tokenization_keeps_rows_and_errors_in_order(tmp_path, monkeypatch, batch_chars):
    """Rows are rendered one by one and tokenized in batches: the store holds what tokenize_conversation gives row
    by row (text rows and rows with images, through the VL tokenizer), and a row refused while rendering and one
    refused after tokenizing (its image file is missing) are reported in row order."""
    monkeypatch.setattr(data_tokenize, "_BATCH_CHARS", batch_chars)
    tokenizer, processor = load_processor(tiny_vl_processor_dir())
    data = tmp_path / "vl"
    shutil.copytree(tiny_vl_chat_path().parent, data)
    lines = (data / "data.jsonl").read_text().splitlines()
    missing = [{"type": "image", "image": "images/missing.png"}, {"type": "text", "text": "And this?"}]
    bad_image = json.dumps(
        {"messages": [{"role": "user", "content": missing}, {"role": "assistant", "content": "No."}]}
    )
    good = load_conversations(data / "data.jsonl")
    for first, second, reported in ((bad_image, "{oops", "missing.png"), ("{oops", bad_image, "invalid JSON")):
        path = data / f"d{len(reported)}.jsonl"
        path.write_text("\n".join([*lines[:3], first, second, *lines[3:]]) + "\n")
        with pytest.raises(DataError, match=rf"row 4: .*{reported}"):
            open_token_store(path, tokenizer, cache_dir=tmp_path / "c", image_processor=processor, num_proc=1)
        store = open_token_store(
            path, tokenizer, cache_dir=tmp_path / "c", image_processor=processor, num_proc=1, on_error="skip"
        )
        assert [m.split(": ", 2)[1] for m in store.manifest["skip_reasons"]] == ["row 4", "row 5"]
        a = _arrays(store)
        assert a["doc_row"].tolist() == [c.row_number + 2 * (c.row_number > 3) for c in good]
        with_images = 0
        for d, c in enumerate(good):
            doc = tokenize_conversation(tokenizer, c.messages, image_processor=processor, base_dir=data)
            start, end = a["doc_offsets"][d], a["doc_offsets"][d + 1]
            assert a["tokens"][start:end].tolist() == doc.input_ids
            assert a["loss_mask"][start:end].tolist() == doc.loss_mask and a["doc_loss"][d] == sum(doc.loss_mask[1:])
            images = a["image_spans"][a["image_offsets"][d] : a["image_offsets"][d + 1]]
            assert [tuple(s) for s in images.tolist()] == list(doc.image_spans)
            with_images += doc.num_images > 0
        assert 0 < with_images < len(good) == store.manifest["counts"]["documents"]
