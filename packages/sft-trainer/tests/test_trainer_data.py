"""Packed chat data: shipped assets, loading and its errors, the assistant loss mask, packing, rank assignment."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
from itertools import accumulate
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from cp_core import build_packed_metadata
from cp_core.testing import GlooWorkers, RankFailure
from sft_trainer.data import (
    IGNORE_INDEX,
    DataError,
    PackedDataset,
    PackedRow,
    ReplicaRows,
    collate_packed,
    load_conversations,
    pack_examples,
    rows_for_rank,
    tiny_chat_path,
    tiny_tokenizer_dir,
    tokenize_conversation,
)

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "make_tiny_assets.py"
PAD = 0


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir())


@pytest.fixture(scope="module")
def conversations():
    return load_conversations(tiny_chat_path())


def _write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def _good(text: str = "hi") -> str:
    return json.dumps({"messages": [{"role": "user", "content": text}, {"role": "assistant", "content": "ok"}]})


def _masked_runs(ids: list[int], mask: list[int]) -> list[list[int]]:
    runs, current = [], []
    for token, flag in zip(ids, mask, strict=True):
        if flag:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return runs


def _doc_ranges(seq_lens) -> list[tuple[int, int]]:
    ends = list(accumulate(seq_lens))
    return list(zip([0, *ends[:-1]], ends, strict=True))


# ---------------------------------------------------------------------------------------------------------
# Shipped assets


def test_tiny_tokenizer_loads_and_round_trips(tokenizer):
    assert 512 <= len(tokenizer) <= 1024
    assert tokenizer.eos_token == tokenizer.pad_token == "<|endoftext|>"
    specials = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    assert len(set(specials)) == 3 and tokenizer.unk_token_id not in specials
    for text in ["What is 2 + 3?", "Reverse the words: red cat blue", "héllo wörld, 日本 🙂\n\n  tabs\tend"]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
    assert text == expected + "<|im_start|>assistant\nhello<|im_end|>\n"
    prompt = tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode(text, add_special_tokens=False))[0] == "<|im_start|>"


def test_tiny_chat_dataset_is_small_valid_and_regenerates(conversations, tmp_path):
    sizes = [tiny_chat_path().stat().st_size, *(p.stat().st_size for p in tiny_tokenizer_dir().iterdir())]
    assert sum(sizes) < 1_000_000
    assert len(conversations) == 400 and conversations.skipped == 0
    assert {len([m for m in c.messages if m["role"] == "assistant"]) for c in conversations} == {1, 2, 3}
    assert any(c.messages[0]["role"] == "system" for c in conversations)
    spec = importlib.util.spec_from_file_location("make_tiny_assets", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--check"]) == 0  # seeded: a fresh build is byte-identical to the shipped files


# ---------------------------------------------------------------------------------------------------------
# Loading and its errors


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("{not json", "invalid JSON"),
        (json.dumps({"text": "hi"}), "missing 'messages'"),
        (json.dumps({"messages": []}), "'messages' is empty"),
        (json.dumps({"messages": "hi"}), "must be a list"),
        (json.dumps({"messages": [{"role": "tool", "content": "x"}]}), "messages[0].role is 'tool'"),
        (json.dumps({"messages": [{"role": "assistant", "content": 3}]}), "messages[0].content must be a string"),
        (json.dumps({"messages": [{"role": "user", "content": "x"}]}), "no assistant message"),
        (json.dumps([1, 2]), "expected an object"),
    ],
)
def test_malformed_row_names_file_and_row(tmp_path, line, problem):
    path = _write_jsonl(tmp_path / "chats.jsonl", [_good(), "", line, _good()])
    with pytest.raises(DataError) as info:
        load_conversations(path)
    message = str(info.value)
    assert "chats.jsonl" in message and "row 3" in message and problem in message, message
    assert isinstance(info.value, ValueError)


def test_skip_mode_counts_malformed_rows(tmp_path):
    path = _write_jsonl(tmp_path / "chats.jsonl", [_good("a"), "{bad", _good("b"), '{"messages": []}', _good("c")])
    loaded = load_conversations(path, on_error="skip")
    assert [(row, msgs[0]["content"]) for _, row, msgs in loaded] == [(1, "a"), (3, "b"), (5, "c")]
    assert loaded.skipped == 2
    assert "row 2" in loaded.skip_reasons[0] and "row 4" in loaded.skip_reasons[1]


def test_a_folder_reads_its_data_files_but_not_hidden_ones(tmp_path):
    """macOS's ``._`` resource forks and files under hidden folders are not data (load_dataset skips them too)."""
    _write_jsonl(tmp_path / "a.jsonl", [_good("a")])
    (tmp_path / "sub").mkdir()
    _write_jsonl(tmp_path / "sub" / "b.jsonl", [_good("b")])
    (tmp_path / "._a.jsonl").write_bytes(b"\x00\x05\x16\x07 Mac OS X resource fork")
    (tmp_path / ".cache").mkdir()
    (tmp_path / ".cache" / "c.jsonl").write_text("{not json")
    loaded = load_conversations(tmp_path)
    assert [msgs[0]["content"] for _, _, msgs in loaded] == ["a", "b"]


def test_a_folder_named_like_a_data_file_is_searched_and_other_entries_are_refused(tmp_path):
    """A folder ``x.jsonl`` is a folder (its files are read); a FIFO would block the reader and a link to nothing
    fail it, so each is named in one line, before any worker starts (the pre-launch check reads the same list)."""
    from sft_trainer.data.sources import file_type_problem, local_files_problem

    _write_jsonl(tmp_path / "a.jsonl", [_good("a")])
    (tmp_path / "inner.jsonl").mkdir()
    _write_jsonl(tmp_path / "inner.jsonl" / "b.jsonl", [_good("b")])
    assert [msgs[0]["content"] for _, _, msgs in load_conversations(tmp_path)] == ["a", "b"]
    assert local_files_problem(str(tmp_path), None) is None

    (tmp_path / "c.jsonl").symlink_to(tmp_path / "gone.jsonl")
    problem = local_files_problem(str(tmp_path), None)
    assert (
        problem == f"{tmp_path / 'c.jsonl'} (in data folder {tmp_path}): a symbolic link to nothing (its target "
        "is missing); remove it or move it out"
    )
    assert file_type_problem(str(tmp_path / "c.jsonl")) == "a symbolic link to nothing (its target is missing)"
    (tmp_path / "c.jsonl").unlink()

    (tmp_path / "linked.jsonl").symlink_to(tmp_path / "inner.jsonl")  # a link to a folder is not searched: said
    assert local_files_problem(str(tmp_path), None) == (
        f"{tmp_path / 'linked.jsonl'} (in data folder {tmp_path}): a link to a folder, whose files are not "
        "searched; put them in the data folder, or name the linked folder in data.path"
    )
    (tmp_path / "linked.jsonl").unlink()

    os.mkfifo(tmp_path / "d.jsonl")
    assert "d.jsonl (in data folder" in local_files_problem(str(tmp_path), None)
    assert "not a regular file (a FIFO" in local_files_problem(str(tmp_path), None)
    with pytest.raises(DataError, match=r"d\.jsonl .*not a regular file"):
        load_conversations(tmp_path)
    assert file_type_problem(str(tmp_path / "d.jsonl")).startswith("not a regular file (a FIFO")
    (tmp_path / "e.jsonl").symlink_to(tmp_path / "d.jsonl")  # a link to a FIFO is named as the FIFO
    assert file_type_problem(str(tmp_path / "e.jsonl")).startswith("not a regular file (a FIFO")


def test_data_files_that_are_all_empty_are_named_before_launch(tmp_path):
    from sft_trainer.data.sources import local_files_problem

    (tmp_path / "a.jsonl").write_text("")
    assert local_files_problem(str(tmp_path / "a.jsonl"), None) == (
        f"{tmp_path / 'a.jsonl'} is empty (0 bytes): no conversations to train on"
    )
    (tmp_path / "b.jsonl").write_text("")
    assert local_files_problem(str(tmp_path), None) == (
        f"all 2 data files in {tmp_path} are empty (0 bytes): no conversations to train on"
    )
    _write_jsonl(tmp_path / "c.jsonl", [_good("c")])  # one file with rows is enough
    assert local_files_problem(str(tmp_path), None) is None


def test_parquet_rows_and_errors(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    good = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    table = pa.table({"messages": [good, None, good], "id": [1, 2, 3]})
    path = tmp_path / "chats.parquet"
    pq.write_table(table, path)
    with pytest.raises(DataError, match=r"chats\.parquet: row 2: 'messages' must be a list"):
        load_conversations(path)
    loaded = load_conversations(tmp_path, on_error="skip")  # a directory: all its data files
    assert [row for _, row, _ in loaded] == [1, 3] and loaded.skipped == 1
    assert loaded[0].messages == good
    pq.write_table(pa.table({"text": ["x"]}), tmp_path / "other.parquet")
    with pytest.raises(DataError, match="no 'messages' column"):
        load_conversations(tmp_path / "other.parquet", on_error="skip")  # a file-level problem always raises


def test_a_row_the_chat_template_fails_on_is_named_and_skippable(tmp_path, tokenizer):
    """The shipped template takes string content only: a row of text parts fails in it. That row is named (file and
    row, with the likely cause), stops the build under on_error='raise' and is skipped under 'skip'."""
    parts = json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                                     {"role": "assistant", "content": "ok"}]})  # fmt: skip
    path = _write_jsonl(tmp_path / "chats.jsonl", [_good("a"), parts, _good("b")])
    with pytest.raises(DataError) as info:
        PackedDataset.build(path, tokenizer, 64)
    assert "chats.jsonl: row 2: the chat template fails on this conversation: TypeError" in str(info.value)
    assert str(info.value).endswith("its content is a list of text parts, which this template may not take: give text "
                                    "as a string")  # fmt: skip
    dataset = PackedDataset.build(path, tokenizer, 64, on_error="skip")
    assert dataset.stats.skipped_malformed == 1 and dataset.stats.documents == 2
    only_parts = _write_jsonl(tmp_path / "parts.jsonl", [parts, parts])  # every row skipped: said as such
    with pytest.raises(DataError, match=r"every row was skipped as malformed \(on_error='skip'\)"):
        PackedDataset.build(only_parts, tokenizer, 64, on_error="skip")


def test_a_run_whose_rows_are_all_skipped_names_the_first_reason(tmp_path, monkeypatch):
    """Through the token store (the trainer's path): 'no packed rows' says every row was skipped, and why the first."""
    from sft_trainer.cli import main

    monkeypatch.setenv("SFT_TRAINER_CACHE", str(tmp_path / "cache"))
    row = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {"role": "assistant", "content": "ok"},
        ]
    }
    path = _write_jsonl(tmp_path / "parts.jsonl", [json.dumps(row)] * 3)
    with pytest.raises(SystemExit) as info:
        main(["inspect-data", "--data.path", str(path), "--data.on_error", "skip"])
    (line,) = str(info.value.code).splitlines()
    assert "skipped_malformed=3" in line
    assert line.endswith(f"every row was skipped as malformed (data.on_error='skip'), the first: {path}: row 1: the chat "
                         "template fails on this conversation: TypeError: can only concatenate str (not \"list\") to "
                         "str; its content is a list of text parts, which this template may not take: give text as a "
                         "string")  # fmt: skip


def test_no_rows_because_every_document_was_dropped_says_so(tmp_path, tokenizer):
    path = _write_jsonl(tmp_path / "chats.jsonl", [_good("a long enough question"), _good("and another one")])
    with pytest.raises(
        DataError, match=r"no packed rows: .*; all 2 document\(s\) were longer than data\.seq_len=8 and"
    ):
        PackedDataset.build(path, tokenizer, 8, overlong="drop")


def test_skipped_rows_reach_the_dataset_stats(tmp_path, tokenizer):
    path = _write_jsonl(tmp_path / "chats.jsonl", [_good("a"), "{bad", _good("b")])
    dataset = PackedDataset.build(path, tokenizer, 64, on_error="skip")
    assert dataset.stats.skipped_malformed == 1 and dataset.stats.documents == 2


# ---------------------------------------------------------------------------------------------------------
# Loss mask


def test_loss_mask_covers_exactly_the_assistant_replies(tokenizer, conversations):
    for conversation in list(conversations)[:60]:
        messages = conversation.messages
        ids, mask = tokenize_conversation(tokenizer, messages)
        assert len(ids) == len(mask)
        assert tokenizer.decode(ids) == tokenizer.apply_chat_template(messages, tokenize=False)
        replies = [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]
        runs = _masked_runs(ids, mask)
        assert [tokenizer.decode(run) for run in runs] == replies
        # Everything unmasked is template, system or user text.
        unmasked = tokenizer.decode([t for t, f in zip(ids, mask, strict=True) if not f])
        assert all(m["content"] in unmasked for m in messages if m["role"] != "assistant")


def test_a_conversation_that_opens_with_a_reply_trains_on_its_text(tokenizer):
    """A reply at messages[0] has nothing rendered before it (apply_chat_template refuses an empty conversation): its
    span starts at its own text, after the template's role header."""
    messages = [
        {"role": "assistant", "content": "hello there"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "how can I help"},
    ]
    ids, mask = tokenize_conversation(tokenizer, messages)
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(messages, tokenize=False)
    assert [tokenizer.decode(run) for run in _masked_runs(ids, mask)] == [
        "hello there<|im_end|>",
        "how can I help<|im_end|>",
    ]
    # a template that opens with a default system prompt holding the reply's text: the span is the reply's own
    preamble = copy.deepcopy(tokenizer)
    preamble.chat_template = (
        "{% if messages[0].role != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    messages = [{"role": "assistant", "content": "helpful"}, {"role": "user", "content": "thanks"}]
    ids, mask = tokenize_conversation(preamble, messages)
    assert [preamble.decode(run) for run in _masked_runs(ids, mask)] == ["helpful<|im_end|>"]
    unmasked = preamble.decode([t for t, f in zip(ids, mask, strict=True) if not f])
    assert unmasked.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>assistant\n")
    # a template that refuses a conversation without a user turn (as Qwen3's do) still renders the stand-in
    needs_user = copy.deepcopy(tokenizer)
    needs_user.chat_template = (
        "{% if messages | selectattr('role', 'equalto', 'user') | list | length == 0 %}"
        "{{ raise_exception('No user query found in messages.') }}{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    ids, mask = tokenize_conversation(needs_user, messages)
    assert [needs_user.decode(run) for run in _masked_runs(ids, mask)] == ["helpful<|im_end|>"]


def test_empty_assistant_turn_adds_no_loss_tokens(tokenizer):
    messages = [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "second"},
        {"role": "assistant", "content": "answer"},
    ]
    ids, mask = tokenize_conversation(tokenizer, messages)
    assert [tokenizer.decode(run) for run in _masked_runs(ids, mask)] == ["answer<|im_end|>"]
    only_empty = tokenize_conversation(
        tokenizer, [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]
    )
    assert only_empty.num_loss_tokens == 0 and len(only_empty.input_ids) > 0
    rows, stats = pack_examples([only_empty], 32, pad_token_id=PAD)
    assert stats.no_loss_documents == 1 and stats.loss_tokens == 0 and rows[0].num_loss_tokens == 0


# ---------------------------------------------------------------------------------------------------------
# Packing


def _check_row(row: PackedRow, seq_len: int) -> None:
    assert row.input_ids.shape == row.labels.shape == (seq_len,)
    assert row.input_ids.dtype == row.labels.dtype == torch.int64
    assert sum(row.seq_lens) == seq_len and all(n > 0 for n in row.seq_lens)
    for _start, end in _doc_ranges(row.seq_lens):
        assert row.labels[end - 1] == IGNORE_INDEX  # the last token of every document predicts nothing
    if row.padding:
        assert row.seq_lens[-1] == row.padding
        assert (row.input_ids[-row.padding :] == PAD).all() and (row.labels[-row.padding :] == IGNORE_INDEX).all()
    assert row.num_loss_tokens == int((row.labels != IGNORE_INDEX).sum())


def test_labels_are_next_tokens_within_documents():
    docs = [
        ([11, 12, 13, 14, 15], [0, 0, 1, 1, 1]),
        ([21, 22, 23], [0, 1, 0]),
        ([31, 32, 33, 34], [1, 1, 1, 1]),  # the first token has no previous token to predict it
    ]
    rows, stats = pack_examples(docs, 16, pad_token_id=PAD, shuffle=False)
    assert len(rows) == 1 and stats.documents == 3
    row = rows[0]
    _check_row(row, 16)
    assert row.seq_lens == (5, 3, 4, 4) and row.padding == 4
    assert row.input_ids.tolist() == [11, 12, 13, 14, 15, 21, 22, 23, 31, 32, 33, 34, PAD, PAD, PAD, PAD]
    m = IGNORE_INDEX
    assert row.labels.tolist() == [m, 13, 14, 15, m, 22, m, m, 32, 33, 34, m, m, m, m, m]
    assert stats.loss_tokens == 7 and stats.padding_tokens == 4


def test_rows_are_exactly_seq_len(tokenizer, conversations):
    dataset = PackedDataset.from_messages(conversations, tokenizer, 128, seed=3)
    stats = dataset.stats
    assert len(dataset) == stats.rows and stats.documents == len(conversations)
    assert stats.truncated == stats.dropped == 0
    assert sum(len(dataset[i].seq_lens) - (dataset[i].padding > 0) for i in range(len(dataset))) == stats.documents
    for i in range(len(dataset)):
        _check_row(dataset[i], 128)
    assert stats.padding_tokens == sum(dataset[i].padding for i in range(len(dataset)))
    assert stats.loss_tokens == sum(dataset[i].num_loss_tokens for i in range(len(dataset))) > 0
    # Labels match the tokenized conversations: the mask, shifted by one inside each document.
    docs = {tuple(d.input_ids): d for d in (tokenize_conversation(tokenizer, c.messages) for c in conversations)}
    row = dataset[0]
    for start, end in _doc_ranges(row.seq_lens[: row.num_documents]):
        doc = docs[tuple(row.input_ids[start:end].tolist())]
        expected = [t if f else IGNORE_INDEX for t, f in zip(doc.input_ids[1:], doc.loss_mask[1:], strict=True)]
        assert row.labels[start:end].tolist() == [*expected, IGNORE_INDEX]
    batch = collate_packed([dataset[0], dataset[1]])
    assert batch["input_ids"].shape == (2, 128) and batch["seq_lens"] == [dataset[0].seq_lens, dataset[1].seq_lens]


def test_full_row_has_no_padding_document():
    rows, stats = pack_examples([([1, 2, 3], [0, 1, 1]), ([4, 5, 6, 7, 8], [0, 0, 0, 1, 1])], 8, pad_token_id=PAD)
    assert len(rows) == 1 and rows[0].padding == 0 and stats.padding_tokens == 0
    assert sorted(rows[0].seq_lens) == [3, 5]


@pytest.mark.parametrize("overlong", ["truncate", "drop"])
def test_overlong_documents_are_truncated_or_dropped_and_counted(overlong):
    long_doc = (list(range(100, 140)), [0] * 10 + [1] * 30)
    docs = [([1, 2, 3, 4], [0, 0, 1, 1]), long_doc, ([5, 6, 7], [0, 1, 1])]
    rows, stats = pack_examples(docs, 16, pad_token_id=PAD, overlong=overlong, seed=0)
    for row in rows:
        _check_row(row, 16)
    if overlong == "truncate":
        assert (stats.truncated, stats.dropped, stats.documents) == (1, 0, 3)
        (truncated,) = [r for r in rows if r.input_ids[0] == 100]
        assert truncated.seq_lens == (16,) and truncated.input_ids.tolist() == list(range(100, 116))
        assert truncated.num_loss_tokens == 6  # tokens 10..15 are targets of 9..14; 15 is the document's last
    else:
        assert (stats.truncated, stats.dropped, stats.documents) == (0, 1, 2)
        assert all(100 not in r.input_ids.tolist() for r in rows)


def test_document_longer_than_a_cp_shard():
    seq_len, cp = 64, 4  # shards of 16 tokens
    docs = [(list(range(1, 51)), [0] * 5 + [1] * 45), (list(range(60, 70)), [0] * 4 + [1] * 6)]
    rows, _ = pack_examples(docs, seq_len, pad_token_id=PAD, shuffle=False)
    (row,) = rows
    _check_row(row, seq_len)
    assert row.seq_lens == (50, 10, 4)
    metas = [build_packed_metadata(row.seq_lens, r, cp, total_len=seq_len) for r in range(cp)]
    assert [m.first_doc_starts_before for m in metas] == [False, True, True, True]
    assert metas[0].last_doc_continues and metas[1].local_seq_lens == (16,)  # rank 1 holds only the middle
    # Pre-shifted labels shard with the ids: the shards concatenate back to the row, cuts inside a document
    # keep their targets (the label of a shard's last token is the next shard's first token).
    shards = [row.labels[m.shard_start : m.shard_end] for m in metas]
    assert torch.equal(torch.cat(shards), row.labels)
    assert shards[0][-1] == row.input_ids[16] == 17


def test_shuffle_is_deterministic(tokenizer, conversations):
    a = PackedDataset.from_messages(conversations, tokenizer, 256, seed=7)
    b = PackedDataset.from_messages(conversations, tokenizer, 256, seed=7)
    c = PackedDataset.from_messages(conversations, tokenizer, 256, seed=8)
    rows = lambda d: [(d[i].input_ids.tolist(), d[i].labels.tolist(), d[i].seq_lens) for i in range(len(d))]  # noqa: E731
    assert rows(a) == rows(b)
    assert rows(a) != rows(c)
    assert a.stats.loss_tokens == c.stats.loss_tokens  # the same documents, in another order


# ---------------------------------------------------------------------------------------------------------
# Ranks


def test_dp_ranks_get_disjoint_rows_and_cp_ranks_the_same(tokenizer, conversations):
    dataset = PackedDataset.from_messages(conversations, tokenizer, 128, seed=0)
    dp, cp = 2, 2
    for epoch in (0, 1):
        # A dp x cp mesh: global rank g has dp rank g // cp and cp rank g % cp; only the dp rank matters.
        by_global = {g: list(rows_for_rank(dataset, g // cp, dp, epoch=epoch).indices) for g in range(dp * cp)}
        assert by_global[0] == by_global[1] and by_global[2] == by_global[3]
        r0, r1 = by_global[0], by_global[2]
        assert len(r0) == len(r1) == len(dataset) // dp and not set(r0) & set(r1)
        subset = rows_for_rank(dataset, 1, dp, epoch=epoch)
        assert torch.equal(subset[0].input_ids, dataset[r1[0]].input_ids)
    assert list(rows_for_rank(dataset, 0, dp, epoch=1).indices) != list(rows_for_rank(dataset, 0, dp).indices)
    with pytest.raises(ValueError, match="dp rank"):
        rows_for_rank(dataset, 2, 2)


class _Rows(list):
    """A dataset of its own indices, with the seed a packed dataset carries."""

    def __init__(self, n: int, seed: int):
        super().__init__(range(n))
        self.seed = seed


def test_replica_rows_equal_per_replica_reshuffled_per_epoch_and_resumable():
    n, dp = 11, 3  # 11 rows do not divide over 3 replicas: 3 each per epoch, 2 left out
    dataset = _Rows(n, seed=5)
    replicas = [ReplicaRows(dataset, r, dp) for r in range(dp)]
    assert [r.per_epoch for r in replicas] == [3, 3, 3]
    epochs = []
    for epoch in range(4):
        rows = [[r[epoch * 3 + i] for i in range(3)] for r in replicas]
        flat = [row for replica in rows for row in replica]
        assert len(flat) == len(set(flat)) == 9  # every row at most once per epoch, across replicas
        assert all(replicas[0].epoch_of(epoch * 3 + i) == epoch for i in range(3))
        epochs.append(rows)
    assert epochs[0][0] == [0, 3, 6]  # epoch 0 keeps the dataset's (already shuffled) order
    assert len({tuple(e[0]) for e in epochs}) == 4  # each epoch another order
    again = ReplicaRows(_Rows(n, seed=5), 1, dp)
    assert [again[p] for p in range(12)] == [row for e in epochs for row in e[1]]  # the same for the seed
    other = ReplicaRows(_Rows(n, seed=6), 1, dp)
    assert [other[p] for p in range(3, 12)] != [row for e in epochs[1:] for row in e[1]]
    # a resumed run starts at data_position = steps done * grad_accum, in any epoch, and reads the same rows
    grad_accum, done = 2, 4
    resumed = ReplicaRows(_Rows(n, seed=5), 2, dp)
    assert [resumed[done * grad_accum + i] for i in range(4)] == [row for e in epochs for row in e[2]][8:12]
    with pytest.raises(DataError, match="cannot feed dp=12"):
        ReplicaRows(dataset, 0, 12)


def _build_in_group(topology, data_dir: str, bad: bool):
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir())
    name = "bad.jsonl" if bad else "chats.jsonl"
    path = Path(data_dir) / name if topology.rank == 0 else Path(data_dir) / "not-read-on-this-rank.jsonl"
    dataset = PackedDataset.build(path, tokenizer, 64, seed=1, group=topology.group)
    return dataset.stats, [(dataset[i].input_ids.tolist(), dataset[i].seq_lens) for i in range(len(dataset))]


def test_rank_zero_builds_and_broadcasts_to_its_group(tmp_path):
    _write_jsonl(tmp_path / "chats.jsonl", [_good(f"q{i}") for i in range(12)])
    _write_jsonl(tmp_path / "bad.jsonl", [_good(), "{oops"])
    with GlooWorkers(world_size=2) as workers:
        (stats0, rows0), (stats1, rows1) = workers.run(_build_in_group, str(tmp_path), False)
        assert stats0 == stats1 and rows0 == rows1 and stats0.documents == 12
        failures = workers.run_collect(_build_in_group, str(tmp_path), True)
    assert all(isinstance(f, RankFailure) for f in failures)
    assert [f.type_name for f in failures] == ["DataError", "DataError"]
    assert all("bad.jsonl: row 2: invalid JSON" in f.message for f in failures)
