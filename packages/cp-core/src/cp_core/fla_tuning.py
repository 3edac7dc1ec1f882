"""fla's autotune choices kept as files, so that a fresh process compiles one config per kernel instead of timing all.

fla's Triton kernels autotune on their first call in a process: every candidate config compiles and runs, which is
most of a model's first step (minutes). fla reads the winning configs from ``{kernel}.json`` files in
``FLA_CONFIG_DIR`` when ``FLA_CACHE_MODE`` is set as it is imported. :func:`use_fla_tuning` points it at the folder
for this GPU and fla version before that import: under ``$CP_FLA_TUNING_DIR`` when set, else under the folder
shipped in this package (``fla_tuning/``, made by ``benchmarks/model_step.py --write-fla-tuning`` on that GPU);
either way ``<root>/<GPU name>/fla-<version>/``, since a config tuned on one GPU may not even compile on another and
a kernel's parameters may change between fla versions. The mode is fla's ``strict``: a kernel whose tuning key
(head counts, head dims, block sizes, dtypes; not the row length) has no entry autotunes as before.
:func:`write_fla_tuning` writes this process's choices into a folder, for later processes and the other nodes of a
cluster.

A user who sets ``FLA_CONFIG_DIR`` or ``FLA_CACHE_MODE`` keeps fla as they set it (``FLA_CACHE_MODE=disabled``
turns the shipped choices off).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import sys
from pathlib import Path

import torch

from cp_core.errors import ContextParallelError

TUNING_DIR_ENV = "CP_FLA_TUNING_DIR"
SHIPPED_TUNING = Path(__file__).parent / "fla_tuning"
_FLA_ENV = ("FLA_CONFIG_DIR", "FLA_CACHE_MODE")


def gpu_folder_name(device_name: str) -> str:
    """``torch.cuda.get_device_name()`` as fla spells it in folder names ("NVIDIA H100 80GB HBM3" ->
    "NVIDIA_H100_80GB_HBM3")."""
    return re.sub(r"[^0-9A-Za-z]+", "_", device_name).strip("_") or "unknown_gpu"


def fla_version() -> str | None:
    """The installed fla's version, read without importing it (None when fla is not installed)."""
    for dist in ("fla-core", "flash-linear-attention"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def tuning_folder(root: str | os.PathLike, device: torch.device | int | None = None) -> Path:
    """``root/<GPU name>/fla-<version>``: where the configs of this GPU and fla version live under ``root``."""
    return Path(root) / gpu_folder_name(torch.cuda.get_device_name(device)) / f"fla-{fla_version()}"


def fla_tuning_dir(device: torch.device | int | None = None) -> Path | None:
    """The folder of tuned configs this process would use on ``device``: under ``$CP_FLA_TUNING_DIR`` when set,
    else the shipped folder for the GPU and fla version when there is one, else None (no GPU, no fla)."""
    if not torch.cuda.is_available() or fla_version() is None:
        return None
    if os.environ.get(TUNING_DIR_ENV):
        return tuning_folder(os.environ[TUNING_DIR_ENV], device)
    shipped = tuning_folder(SHIPPED_TUNING, device)
    return shipped if shipped.is_dir() else None


def use_fla_tuning(device: torch.device | int | None = None) -> Path | None:
    """Point fla at the tuned configs for ``device`` (sets ``FLA_CONFIG_DIR`` and ``FLA_CACHE_MODE=strict`` in this
    process's environment). Returns the folder, or None where nothing was set: no folder for this GPU, the user set
    fla's variables, or fla is already imported (it reads them once, at import: call this first)."""
    if any(name in os.environ for name in _FLA_ENV) or "fla" in sys.modules:
        return None
    folder = fla_tuning_dir(device)
    if folder is None:
        return None
    os.environ["FLA_CONFIG_DIR"] = str(folder)
    os.environ["FLA_CACHE_MODE"] = "strict"
    return folder


def _fla_autotuners() -> list:
    """Every autotuned fla kernel this process has imported (fla's CachedAutotuner, which can read its choices
    back)."""
    try:
        from fla.ops.utils.cache import CachedAutotuner
    except ImportError as exc:
        raise ContextParallelError(f"fla's config cache (fla.ops.utils.cache) is not importable: {exc}") from None
    found: dict[int, object] = {}
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "fla" or name.startswith("fla.")):
            continue
        for value in list(vars(module).values()):
            for _ in range(4):  # a kernel's decorators nest (triton.heuristics around the autotuner): follow .fn
                if isinstance(value, CachedAutotuner):
                    found[id(value)] = value
                    break
                value = getattr(value, "fn", None)
    return list(found.values())


def _config_entry(config) -> dict:
    entry = {
        "kwargs": dict(config.kwargs),
        "num_warps": config.num_warps,
        "num_stages": config.num_stages,
        "num_ctas": config.num_ctas,
    }
    if getattr(config, "maxnreg", None) is not None:
        entry["maxnreg"] = config.maxnreg
    return entry


def tuned_fla_configs() -> dict[str, dict[str, dict]]:
    """kernel name -> {key hash -> {"autotune_key", "config"}} for every choice this process's fla kernels have
    made, in fla's config-file layout."""
    from fla.ops.utils.cache import AutotuneKey

    kernels: dict[str, dict[str, dict]] = {}
    for tuner in _fla_autotuners():
        for key, config in tuner.cache.items():
            entries = kernels.setdefault(tuner.kernel_name, {})
            entries[AutotuneKey.key_hash(key)] = {
                "autotune_key": AutotuneKey.normalize_autotune_key(key),
                "config": _config_entry(config),
            }
    return kernels


def write_fla_tuning(folder: str | os.PathLike) -> int:
    """Write this process's fla autotune choices into ``folder`` (one ``{kernel}.json`` per kernel, merged with
    the entries already there, each file replaced atomically). Returns the number of entries written."""
    import triton

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = 0
    for kernel, entries in sorted(tuned_fla_configs().items()):
        path = folder / f"{kernel}.json"
        merged: dict[str, dict] = {}
        if path.exists():
            try:
                merged = dict(json.loads(path.read_text()).get("autotune_entries") or {})
            except (OSError, ValueError, AttributeError):
                merged = {}  # an unreadable file is rewritten from this process's choices
        merged.update(entries)
        payload = {"kernel_name": kernel, "triton_version": triton.__version__, "autotune_entries": merged}
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(payload, indent=1, sort_keys=True) + "\n")
        tmp.replace(path)
        written += len(entries)
    return written
