"""Data in the forms users have it: local JSONL/Parquet files, Hugging Face ``datasets`` folders, local files
read with ``load_dataset``, hub dataset ids; ``messages`` under another column name; the ShareGPT layout.

JSONL and Parquet files (or folders of them) are read by :mod:`sft_trainer.data`'s readers, whose errors name the
file and the 1-based row. Everything else goes through the optional ``datasets`` library
(``pip install 'sft-trainer[datasets]'``) and is written once, the conversation column only, as a JSONL file in
the token cache (``<cache>/datasets/``, named by the dataset's fingerprint and the column); that file then
takes the same path as a local JSONL file (same token store, same per-row errors, rows numbered from 1 in the
dataset's order, shown under the dataset's name). ``datasets`` >= 4 runs no dataset scripts, and nothing here
passes ``trust_remote_code``: a dataset is data, never code.

Records: the conversation is in ``data.messages_column`` (unset: ``messages``, or ``conversations`` when a record
has no ``messages``). A list of ``{"from", "value"}`` turns (ShareGPT: ``from`` is human, gpt or system) becomes
``{"role", "content"}`` messages (user, assistant, system).
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import threading
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from sft_trainer.data.conversations import (
    _JSONL_SUFFIXES,
    _PARQUET_SUFFIXES,
    DataError,
    _expand_paths,
    _open_parquet,
    not_a_regular_file,
)
from sft_trainer.hub import is_hub_id

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
"""ShareGPT ``from`` values and the chat role each becomes."""
DEFAULT_COLUMNS = ("messages", "conversations")
_LOAD_DATASET_SUFFIXES = {".json": "json", ".jsonl": "json", ".ndjson": "json", ".parquet": "parquet", ".pq": "parquet"}
_SAVED_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


def conversation_column(names: Collection[str], configured: str | None) -> str:
    """The column holding the conversation: ``configured`` when set, else ``messages``, else ``conversations``
    when that is present (``messages`` when neither is, for the error)."""
    if configured:
        return configured
    return next((name for name in DEFAULT_COLUMNS if name in names), DEFAULT_COLUMNS[0])


def sharegpt_to_messages(turns: list[Any]) -> list[Any]:
    """ShareGPT turns ``{"from": human | gpt | system, "value": str}`` as ``{"role", "content"}`` messages; other
    entries are kept as they are (and reported by :func:`sft_trainer.data.validate_messages`)."""
    messages = []
    for i, turn in enumerate(turns):
        if isinstance(turn, Mapping) and "from" in turn and "role" not in turn:
            speaker = turn["from"]
            if speaker not in SHAREGPT_ROLES:
                raise ValueError(
                    f"conversations[{i}].from is {speaker!r}; ShareGPT turns are from {', '.join(SHAREGPT_ROLES)}"
                )
            messages.append({"role": SHAREGPT_ROLES[speaker], "content": turn.get("value")})
        else:
            messages.append(turn)
    return messages


def row_messages(row: Any, configured_column: str | None) -> Any:
    """``{"messages": [...]}`` of one record: its conversation column, ShareGPT turns converted. Records that are
    not objects are returned unchanged (the validator reports them); a missing column raises naming it."""
    if not isinstance(row, Mapping):
        return row
    column = conversation_column(row, configured_column)
    if column not in row:
        hint = "" if configured_column else "; set data.messages_column to the column that holds the conversation"
        raise ValueError(f"missing '{column}' (row keys: {sorted(map(str, row))}){hint}")
    turns = row[column]
    return {"messages": sharegpt_to_messages(turns) if isinstance(turns, list) else turns}


# --------------------------------------------------------------------------------------------------------
# Sources


def reads_directly(path: str) -> bool:
    """Whether ``path`` is read by the JSONL/Parquet readers: a ``.jsonl``/``.parquet`` file, or a folder of
    them that is not a ``save_to_disk`` folder."""
    p = Path(path)
    if p.is_file():
        return p.suffix in _JSONL_SUFFIXES + _PARQUET_SUFFIXES
    if p.is_dir():
        return not any((p / marker).is_file() for marker in _SAVED_MARKERS)
    return False


def file_type_problem(path: str) -> str | None:
    """Why no reader takes the existing file ``path`` (its suffix), or None: said before any worker starts."""
    local = Path(path)
    if problem := not_a_regular_file(local):
        return problem
    if local.is_file() and local.suffix not in _LOAD_DATASET_SUFFIXES:
        return f"unsupported data file type {local.suffix!r}; use .jsonl, .json or .parquet"
    return None


def parquet_column(path: Path, messages_column: str | None) -> str:
    """The conversation column of a Parquet file (see :func:`conversation_column`)."""
    import pyarrow.parquet as pq

    return conversation_column(pq.read_schema(path).names, messages_column)


def open_parquet(path: Path, messages_column: str | None):
    """``(pyarrow ParquetFile, its conversation column)``; DataError naming the file when it does not read as
    Parquet or has no such column."""
    try:
        column = parquet_column(path, messages_column)
    except Exception as exc:
        raise DataError(f"{path}: cannot read as Parquet ({exc})") from exc
    return _open_parquet(path, column), column


def local_files_problem(path: str, messages_column: str | None) -> str | None:
    """Why the JSONL/Parquet files ``path`` names cannot be read, or None: a folder without data files, files that
    are all empty, a Parquet file whose footer does not read or lacks the conversation column. Only sizes and
    footers are read: said before any worker starts."""
    if not reads_directly(path):
        return None
    try:
        files = _expand_paths(path)
        if all(file.stat().st_size == 0 for file in files):
            what = f"{files[0]} is" if len(files) == 1 else f"all {len(files)} data files in {path} are"
            return f"{what} empty (0 bytes): no conversations to train on"
        for file in files:
            if file.suffix in _PARQUET_SUFFIXES:
                open_parquet(file, messages_column)
    except (DataError, OSError) as exc:
        return str(exc)
    return None


def needs_datasets(path: str) -> bool:
    """Whether ``path`` is loaded through ``datasets``: a ``save_to_disk`` folder, a ``.json`` file, a glob of
    data files, or a hub dataset id (``org/name``; a missing ``dir/file.jsonl`` is a missing file, not an id)."""
    if reads_directly(path):
        return False
    hub_id = is_hub_id(path) and Path(path).suffix not in _LOAD_DATASET_SUFFIXES
    return Path(path).exists() or "*" in path or hub_id


def resolve_data_files(
    paths: Any,
    cache: Path,
    *,
    messages_column: str | None = None,
    split: str | None = None,
    subset: str | None = None,
) -> tuple[list[Path], dict[str, str], dict[str, str]]:
    """``(files, labels, dirs)``: the JSONL/Parquet files to tokenize, and for each file written from a
    ``datasets`` source the dataset's name (for error messages) and the folder its relative image paths start
    from (a ``save_to_disk`` folder itself, a data file's folder; none for a hub id)."""
    single = isinstance(paths, str | os.PathLike)
    if not single or not needs_datasets(str(paths)):
        return _expand_paths(paths), {}, {}
    datasets = _import_datasets()
    _thread_lock_for_tqdm()
    bars = datasets.is_progress_bar_enabled()  # off while loading: the data cache lines say what is built
    datasets.disable_progress_bars()
    try:
        dataset, label = load_hf_dataset(str(paths), split=split, subset=subset)
        path = materialize(dataset, label, cache, messages_column)
    finally:
        if bars:
            datasets.enable_progress_bars()
    local = Path(str(paths))
    base = local if local.is_dir() else local.parent if (local.exists() or "*" in str(paths)) else None
    dirs = {str(path): str(base.resolve())} if base is not None and "*" not in base.name else {}
    return [path], {str(path): label}, dirs


def _thread_lock_for_tqdm() -> None:
    """Give tqdm a thread lock unless it has one: its default lock holds a multiprocessing semaphore (created even
    for hidden bars, e.g. by load_from_disk), which a training worker leaving with os._exit leaks, and the
    launcher then warns about a leaked semaphore."""
    from tqdm import tqdm

    if not hasattr(tqdm, "_lock"):
        tqdm.set_lock(threading.RLock())


def _import_datasets():
    try:
        import datasets
    except ImportError:
        raise DataError(
            "reading this data needs the Hugging Face datasets library: pip install 'sft-trainer[datasets]' "
            "(JSONL and Parquet files are read without it)"
        ) from None
    return datasets


def load_hf_dataset(path: str, *, split: str | None = None, subset: str | None = None) -> tuple[Any, str]:
    """``(datasets.Dataset, label)`` for a ``save_to_disk`` folder, local data files (a ``.json`` file or a glob),
    or a hub dataset id (``split`` default ``train``, ``subset`` its configuration). Raises :class:`DataError`
    in one line (offline or unknown hub ids name HF_HUB_OFFLINE / HF_DATASETS_OFFLINE)."""
    datasets = _import_datasets()
    local = Path(path)
    if local.is_dir():
        try:
            loaded = datasets.load_from_disk(str(local))
        except Exception as exc:
            raise DataError(f"{path}: not a folder written by save_to_disk ({type(exc).__name__}: {exc})") from None
        label = str(local)
        if isinstance(loaded, datasets.DatasetDict):
            name = split or "train"
            if name not in loaded:
                raise DataError(f"{path}: no split {name!r} (splits: {sorted(loaded)}); set data.split")
            loaded, label = loaded[name], f"{local} [{name}]"
        return loaded, label
    if local.exists() or "*" in path:
        builder = _LOAD_DATASET_SUFFIXES.get(local.suffix)
        if builder is None:
            raise DataError(f"{path}: unsupported data file type {local.suffix!r}; use .jsonl, .json or .parquet")
        try:
            return datasets.load_dataset(builder, data_files=path, split="train"), path
        except Exception as exc:
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise DataError(f"{path}: cannot be read as {builder} ({type(exc).__name__}: {reason})") from None
    name = split or "train"
    label = f"{path}" + (f" ({subset})" if subset else "") + f" [{name}]"
    try:
        return datasets.load_dataset(path, subset, split=name), label
    except Exception as exc:
        raise DataError(_hub_problem(path, subset, name, exc, datasets)) from None


def _hub_problem(path: str, subset: str | None, split: str, exc: Exception, datasets: Any) -> str:
    reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    what = f"hub dataset {path!r}" + (f" subset {subset!r}" if subset else "") + f" split {split!r}"
    if datasets.config.HF_HUB_OFFLINE:
        return (
            f"{what}: not a local path, and HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set and it is not in the "
            f"datasets cache ({datasets.config.HF_DATASETS_CACHE}): load it once online, or give a local file or "
            f"save_to_disk folder ({type(exc).__name__}: {reason})"
        )
    return (
        f"{what}: not a local path, and the Hugging Face Hub did not provide it ({type(exc).__name__}: {reason}); "
        "check the id, data.subset, data.split and the network, or set HF_HUB_OFFLINE=1 and "
        "HF_DATASETS_OFFLINE=1 to use the datasets cache only"
    )


def _json_ready(value: Any) -> Any:
    """A decoded record as JSON: image bytes (raw, or an Image feature's ``{"bytes", "path"}``, or a decoded
    ``PIL.Image``) become ``data:image;base64,`` URIs, which the image reader takes like the bytes."""
    if isinstance(value, bytes):
        return "data:image;base64," + base64.b64encode(value).decode("ascii")
    if isinstance(value, Mapping):
        if set(value) == {"bytes", "path"}:
            return _json_ready(value["bytes"]) if value["bytes"] else value["path"]
        return {str(k): _json_ready(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_ready(v) for v in value]
    if hasattr(value, "save") and hasattr(value, "mode"):  # a PIL image (an Image feature, decoded)
        buffer = io.BytesIO()
        value.save(buffer, format="PNG")
        return _json_ready(buffer.getvalue())
    return value


def materialize(dataset: Any, label: str, cache: Path, messages_column: str | None) -> Path:
    """The conversation column of ``dataset`` as a JSONL file under ``cache/datasets`` (one record per line, so a
    line number is the row number; written once per dataset fingerprint, arrow files and column, renamed into place
    when complete). Records are written as ``datasets`` decodes them (Json features included), so the rows are the
    ones the dataset holds. Raises naming a missing column."""
    names = list(dataset.column_names)
    column = conversation_column(names, messages_column)
    if column not in names:
        setting = f"data.messages_column={messages_column!r}" if messages_column else "data.messages_column is unset"
        raise DataError(
            f"{label}: no column {column!r} ({setting}; columns: {names}): set data.messages_column to the column "
            "that holds the conversation"
        )
    files = [f["filename"] for f in dataset.cache_files]
    identity = {
        "fingerprint": dataset._fingerprint,
        "files": [[f, os.stat(f).st_size, os.stat(f).st_mtime_ns] for f in files if os.path.exists(f)],
        "rows": len(dataset),
        "column": column,
    }
    digest = hashlib.blake2b(json.dumps(identity, sort_keys=True).encode(), digest_size=12).hexdigest()
    folder = (cache / "datasets").resolve()  # absolute, as the store's manifest names its sources
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / f"{digest}.jsonl"
    if final.is_file():
        return final
    tmp = folder / f".{digest}.{os.getpid()}.tmp"
    try:
        with tmp.open("w", encoding="utf-8") as out:
            for record in dataset.select_columns([column]):
                out.write(json.dumps(_json_ready(record), ensure_ascii=False) + "\n")
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    return final
