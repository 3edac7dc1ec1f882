"""Data in the forms users have it, through the HF datasets library: a save_to_disk folder (and a DatasetDict split),
local .json and Parquet files through load_dataset, ShareGPT records, another messages column; each must give the
same tokens as the plain JSONL file. Mistakes (a wrong column, a ShareGPT role, an offline hub id) give one line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from sft_trainer.config import ConfigError, load_config
from sft_trainer.data import (
    DataError,
    load_processor,
    tiny_chat_path,
    tiny_tokenizer_dir,
    tiny_vl_chat_path,
    tiny_vl_processor_dir,
)
from sft_trainer.data.rows import open_packed_store, open_token_store
from sft_trainer.data.sources import row_messages, sharegpt_to_messages

datasets = pytest.importorskip("datasets")

SHAREGPT = {"user": "human", "assistant": "gpt", "system": "system"}


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir())


@pytest.fixture(scope="module")
def records() -> list[dict]:
    return [json.loads(line) for line in tiny_chat_path().read_text().splitlines()[:24]]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, records, tokenizer) -> np.ndarray:
    """The tokens of the records as a plain messages JSONL file."""
    folder = tmp_path_factory.mktemp("reference")
    path = folder / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return np.array(_store(path, tokenizer, folder / "cache").arrays["tokens"])


def _store(path, tokenizer, cache, **source):
    return open_token_store(str(path), tokenizer, cache_dir=cache, num_proc=1, log=lambda _: None, **source)


def _sharegpt(record: dict) -> dict:
    return {"conversations": [{"from": SHAREGPT[m["role"]], "value": m["content"]} for m in record["messages"]]}


def test_sharegpt_turns_become_messages():
    turns = [
        {"from": "system", "value": "Be brief."},
        {"from": "human", "value": "2 + 2?"},
        {"from": "gpt", "value": "4"},
    ]
    assert sharegpt_to_messages(turns) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2 + 2?"},
        {"role": "assistant", "content": "4"},
    ]
    assert row_messages({"conversations": turns, "id": 7}, None) == {"messages": sharegpt_to_messages(turns)}
    assert row_messages({"chat": [{"role": "user", "content": "x"}]}, "chat") == {
        "messages": [{"role": "user", "content": "x"}]
    }
    with pytest.raises(ValueError, match=r"conversations\[1\]\.from is 'bot'; ShareGPT turns are from human, "):
        sharegpt_to_messages([turns[1], {"from": "bot", "value": "4"}])


def test_save_to_disk_sharegpt_folder_gives_the_jsonl_tokens(tmp_path, records, tokenizer, reference):
    folder = tmp_path / "sharegpt"
    datasets.Dataset.from_list([_sharegpt(r) for r in records]).save_to_disk(str(folder))
    store = _store(folder, tokenizer, tmp_path / "cache")
    np.testing.assert_array_equal(store.arrays["tokens"], reference)
    assert store.num_documents == len(records)
    assert store.manifest["key_inputs"]["options"]["source_labels"] == {store.manifest["sources"][0]: str(folder)}
    # The dataset's identity is part of the key: the same folder with other records is another store.
    shutil.rmtree(folder)
    datasets.Dataset.from_list([_sharegpt(r) for r in records[:5]]).save_to_disk(str(folder))
    other = _store(folder, tokenizer, tmp_path / "cache")
    assert other.path != store.path and other.num_documents == 5


def test_dataset_dict_folder_takes_the_split(tmp_path, records, tokenizer):
    folder = tmp_path / "dict"
    parts = {"train": records[:10], "test": records[10:13]}
    datasets.DatasetDict({k: datasets.Dataset.from_list(v) for k, v in parts.items()}).save_to_disk(str(folder))
    assert _store(folder, tokenizer, tmp_path / "cache").num_documents == 10
    assert _store(folder, tokenizer, tmp_path / "cache", split="test").num_documents == 3
    with pytest.raises(DataError, match=r"no split 'dev' \(splits: \['test', 'train'\]\); set data.split$"):
        _store(folder, tokenizer, tmp_path / "cache", split="dev")


def test_json_with_another_column_and_parquet_glob_through_load_dataset(tmp_path, records, tokenizer, reference):
    array = tmp_path / "chat.json"  # a JSON array: read by load_dataset("json")
    array.write_text(json.dumps([{"id": i, "chat": r["messages"]} for i, r in enumerate(records)]))
    store = _store(array, tokenizer, tmp_path / "cache", messages_column="chat")
    np.testing.assert_array_equal(store.arrays["tokens"], reference)
    for i, part in enumerate((records[:10], records[10:])):
        datasets.Dataset.from_list(part).to_parquet(str(tmp_path / f"train-{i}.parquet"))
    store = _store(tmp_path / "train-*.parquet", tokenizer, tmp_path / "cache")
    np.testing.assert_array_equal(store.arrays["tokens"], reference)


def test_a_wrong_column_is_one_line_naming_it(tmp_path, records, tokenizer):
    array = tmp_path / "chat.json"
    array.write_text(json.dumps([{"chat": r["messages"]} for r in records]))
    with pytest.raises(DataError) as info:
        _store(array, tokenizer, tmp_path / "cache", messages_column="dialog")
    assert str(info.value) == (
        f"{array}: no column 'dialog' (data.messages_column='dialog'; columns: ['chat']): set data.messages_column "
        "to the column that holds the conversation"
    )
    local = tmp_path / "chat.parquet"  # read by the Parquet reader: its message names the file
    datasets.Dataset.from_list([{"chat": r["messages"]} for r in records]).to_parquet(str(local))
    with pytest.raises(DataError, match=r"chat\.parquet: no 'dialog' column \(data.messages_column\) \(columns: "):
        _store(local, tokenizer, tmp_path / "cache", messages_column="dialog")


def test_local_jsonl_keeps_file_and_row_errors_with_mapping_and_sharegpt(tmp_path, records, tokenizer, reference):
    path = tmp_path / "sharegpt.jsonl"
    path.write_text("".join(json.dumps(_sharegpt(r)) + "\n" for r in records))
    np.testing.assert_array_equal(_store(path, tokenizer, tmp_path / "cache").arrays["tokens"], reference)
    bad = _sharegpt(records[1])
    bad["conversations"][0]["from"] = "robot"
    path.write_text(json.dumps(_sharegpt(records[0])) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(DataError, match=rf"^{path}: row 2: conversations\[0\]\.from is 'robot'; ShareGPT turns"):
        _store(path, tokenizer, tmp_path / "cache")
    path.write_text(json.dumps({"chat": records[0]["messages"]}) + "\n" + json.dumps({"talk": []}) + "\n")
    with pytest.raises(DataError, match=rf"^{path}: row 2: missing 'chat' \(row keys: \['talk'\]\)$"):
        _store(path, tokenizer, tmp_path / "cache", messages_column="chat")


def test_datasets_row_errors_name_the_dataset_and_row(tmp_path, records, tokenizer):
    rows = [_sharegpt(r) for r in records[:4]]
    rows[2]["conversations"][1]["from"] = "bot"
    folder = tmp_path / "bad"
    datasets.Dataset.from_list(rows).save_to_disk(str(folder))
    with pytest.raises(DataError, match=rf"^{folder}: row 3: conversations\[1\]\.from is 'bot'"):
        _store(folder, tokenizer, tmp_path / "cache")


def test_offline_hub_id_is_one_line(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    result = subprocess.run(
        [sys.executable, "-m", "sft_trainer.run", "inspect-data", "--data.path", "no-org/no-such-set"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr
    assert lines[-1].startswith(
        "sft-train inspect-data: data.path='no-org/no-such-set': hub dataset 'no-org/no-such-set' split 'train': not "
        "a local path, and HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set"
    )


def test_config_takes_hub_ids_and_globs_but_names_a_missing_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert load_config(None, ["--data.path", "org/chat-set", "--data.split", "test"]).data.split == "test"
    assert load_config(None, ["--data.path", "shards/*.parquet"]).data_path == "shards/*.parquet"
    with pytest.raises(ConfigError, match=r"data.path='data/chat.jsonl': no such file or folder"):
        load_config(None, ["--data.path", "data/chat.jsonl"])


def test_relative_image_paths_of_a_json_file_start_at_its_folder(tmp_path):
    """A .json file beside its images (read by load_dataset; contents mix strings and lists of parts, which
    datasets keeps as Json features) gives the rows of the same records as JSONL there, pixels included."""
    tokenizer, processor = load_processor(tiny_vl_processor_dir())
    folder = tmp_path / "vl"
    shutil.copytree(tiny_vl_chat_path().parent, folder)
    records = [json.loads(line) for line in tiny_vl_chat_path().read_text().splitlines()[:6]]
    assert {type(m["content"]) for r in records for m in r["messages"]} == {str, list}
    (folder / "six.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (folder / "six.json").write_text(json.dumps(records))
    rows = [
        open_packed_store(str(folder / name), tokenizer, 256, image_processor=processor, cache_dir=tmp_path / "c")
        for name in ("six.jsonl", "six.json")
    ]
    assert len(rows[0]) == len(rows[1]) > 0
    for a, b in zip(rows[0], rows[1], strict=True):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)
        assert torch.equal(a.pixel_values, b.pixel_values) and torch.equal(a.image_grid_thw, b.image_grid_thw)


def test_without_datasets_installed_it_says_what_to_install(tmp_path, monkeypatch, tokenizer):
    folder = tmp_path / "saved"
    datasets.Dataset.from_list([{"messages": [{"role": "assistant", "content": "hi"}]}]).save_to_disk(str(folder))
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets raises ImportError
    with pytest.raises(DataError, match=r"^reading this data needs the Hugging Face datasets library: pip install "):
        _store(folder, tokenizer, tmp_path / "cache")
