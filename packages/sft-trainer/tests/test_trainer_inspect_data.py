"""`sft-train inspect-data`: the marked spans are exactly the tokens with labels, a small row renders to the exact
ChatML text with the replies bracketed, colour on a terminal and brackets otherwise, image pad runs shown compactly,
and the statistics line carries the pack plan's numbers."""

from __future__ import annotations

import io
import json
import re
import sys

import pytest

from sft_trainer.cli import main as run_main
from sft_trainer.config import load_config
from sft_trainer.data import IGNORE_INDEX, VisionTokens, tiny_chat_path, tiny_vl_processor_dir
from sft_trainer.inspect_data import LOSS_OFF, LOSS_ON, inspect, render_document
from sft_trainer.tokenizer_fit import load_tokenizer

ARGS = ["--data.seq_len", "128", "--data.num_proc", "1"]
HEADER = re.compile(r"^--- document \d+/\d+ \((.+): row (\d+); (\d+) tokens\) ---$", re.M)


@pytest.fixture(scope="module")
def built():
    cfg = load_config(None, ARGS)
    out = io.StringIO()
    dataset = inspect(cfg, 3, color=False, out=out)
    return dataset, out.getvalue(), load_tokenizer(cfg.tokenizer_path)


def _chatml(messages: list[dict]) -> str:
    """The shipped template's text with each reply and its end-of-turn marker in brackets."""
    parts = []
    for m in messages:
        if m["role"] == "assistant":
            parts.append(f"<|im_start|>assistant\n[[{m['content']}<|im_end|>]]\n")
        else:
            parts.append(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n")
    return "".join(parts)


def test_marked_spans_are_the_labelled_tokens(built):
    dataset, text, tokenizer = built
    rows = text.split("=== row ")[1:]
    assert len(rows) == 3
    for index, rendered in enumerate(rows):
        row = dataset[index]
        ids, labels = row.input_ids.tolist(), row.labels.tolist()
        runs, current = [], []
        for t in range(len(labels)):  # label t is the loss of token t + 1
            if labels[t] != IGNORE_INDEX:
                assert labels[t] == ids[t + 1]
                current.append(ids[t + 1])
            elif current:
                runs.append(current)
                current = []
        if current:
            runs.append(current)
        expected = [tokenizer.decode(r, skip_special_tokens=False, clean_up_tokenization_spaces=False) for r in runs]
        assert re.findall(r"\[\[(.*?)\]\]", rendered, re.S) == expected
        assert sum(len(r) for r in runs) == row.num_loss_tokens > 0


def test_one_row_is_exact_chatml_with_the_replies_bracketed(built):
    dataset, text, _ = built
    records = tiny_chat_path().read_text().splitlines()
    index, rendered = next((i, r) for i, r in enumerate(text.split("=== row ")[1:]) if "truncated from" not in r)
    headers = HEADER.findall(rendered)
    assert [int(tokens) for _, _, tokens in headers] == list(dataset[index].seq_lens[: len(headers)])
    body = rendered.split("\n", 1)[1].split("\npacking: ")[0]
    expected = []
    for k, (source, number, tokens) in enumerate(headers):
        assert source == str(tiny_chat_path())
        expected.append(f"--- document {k + 1}/{len(headers)} ({source}: row {number}; {tokens} tokens) ---")
        expected.append(_chatml(json.loads(records[int(number) - 1])["messages"]))
    padding = dataset[index].padding
    if padding:
        expected.append(f"--- padding: <pad x{padding}> ---")
    assert body.rstrip("\n") == "\n".join(expected).rstrip("\n")


def test_stats_line_equals_the_pack_plan(built):
    dataset, text, _ = built
    s = dataset.stats
    line = text.strip().splitlines()[-1]
    assert line == (
        f"packing: {s.rows} rows of 128 tokens, {s.documents} documents, {s.padding_tokens} padding tokens "
        f"({s.padding_tokens / (s.rows * 128):.2%}), {s.loss_tokens} loss tokens, {s.truncated} truncated, "
        f"{s.dropped} dropped, {s.skipped_malformed} skipped as malformed, {s.no_loss_documents} without loss tokens"
    )
    assert (s.rows, s.documents) == (len(dataset), 400)


def test_brackets_off_a_terminal_and_colour_on_one(built, capsys, monkeypatch):
    run_main(["inspect-data", "--rows", "1", *ARGS])
    plain = capsys.readouterr().out
    assert "[[" in plain and "\x1b[" not in plain
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    run_main(["inspect-data", "--rows", "1", *ARGS])
    coloured = capsys.readouterr().out
    assert "[[" not in coloured and LOSS_ON in coloured
    assert coloured.replace(LOSS_ON, "[[").replace(LOSS_OFF, "]]") == plain


def test_image_pad_runs_and_truncation(capsys):
    vl = load_tokenizer(tiny_vl_processor_dir())
    tokens = VisionTokens().ids(vl)
    start, pad, end = tokens["vision_start"], tokens["image_pad"], tokens["vision_end"]
    reply = vl.encode("red", add_special_tokens=False)
    ids = [start, pad, pad, pad, end, *reply]
    rendered = render_document(vl, ids, [False] * 5 + [True] * len(reply), color=False, image_pad=pad)
    assert rendered == "<|vision_start|><image x3><|vision_end|>[[red]]"
    run_main(["inspect-data", "--rows", "1", "--data.seq_len", "16", "--data.num_proc", "1"])
    out = capsys.readouterr().out
    assert re.search(r"; 16 tokens, truncated from \d+\) ---", out)
    assert re.search(r"packing: \d+ rows of 16 tokens, 400 documents, .* 400 truncated, 0 dropped", out)
