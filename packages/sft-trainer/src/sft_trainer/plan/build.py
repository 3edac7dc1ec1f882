"""The plan of a validated TrainConfig: per layer type traffic, memory per rank, the longest row, the problems."""

from __future__ import annotations

import os
from typing import Any

from sft_trainer.plan.coefficients import DTYPE_BYTES, GIB, H200_GIB, NVLINK_GBPS, PLANNED_CPS
from sft_trainer.plan.memory import _min_seq_len, estimate_memory, longest_seq_len
from sft_trainer.plan.parameters import _family, _head_dim, count_parameters, layer_kinds
from sft_trainer.plan.traffic import (
    gdn_bytes,
    kv_gather_attention_bytes,
    kv_ring_attention_bytes,
    mamba_bytes,
    ulysses_attention_bytes,
)
from sft_trainer.plan.validity import attention_strategy, valid_cp


def _text_config_of(cfg):
    """(text config, vision parameters, notes) of the config's model; presets take the shipped tokenizer's vocab."""
    from sft_trainer.config import is_vision_language, resolve_model_config

    vocab = None
    notes = []
    if cfg.model.path is None and cfg.model.config is None:
        vocab = tokenizer_vocab(cfg.tokenizer_path)
    hf = resolve_model_config(cfg.model, vocab_size=vocab)
    vision = 0
    if is_vision_language(hf):
        import torch

        from cp_models import load_text_config
        from cp_vlm.qwen3_5_vl import build_vision_tower

        with torch.device("meta"):
            vision = sum(p.numel() for p in build_vision_tower(hf).parameters())
        notes.append("vision tower: parameters counted; its activations (image-dependent) are not")
        return load_text_config(hf), vision, notes
    if _family(hf) == "qwen3_5":
        from cp_models import load_text_config

        hf = load_text_config(hf)
    return hf, vision, notes


def tokenizer_vocab(folder: str) -> int | None:
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path).get_vocab_size(with_added_tokens=True)


def _default_gpu_gib() -> float:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_properties(0).total_memory / GIB
    except Exception:  # pragma: no cover - a broken CUDA setup plans for an H200
        pass
    return H200_GIB


def _kind_names() -> dict[tuple[str, str], tuple[str, str]]:
    """(family, planner layer part) -> (HF layer type, what it is), from the family specs."""
    from cp_models.families import FAMILIES

    return {(name, part): names for name, family in FAMILIES.items() for part, names in family.layer_parts.items()}


def _layer_rows(
    text_config, seq_len: int, cp: int, style: str, elem: int, recompute: bool, per_token, attention_cp: str = "ulysses"
):
    family = _family(text_config)
    counts: dict[str, int] = {}
    kinds = layer_kinds(text_config)
    for kind in [m for m, _ in kinds] + [f for _, f in kinds if f]:  # token mixers first, then feed-forwards
        counts[kind] = counts.get(kind, 0) + 1
    rows = []
    for kind, count in counts.items():
        layer_type, name = _kind_names()[(family, kind)]
        comm = "none"
        if kind == "attention":
            q, kv, d = text_config.num_attention_heads, text_config.num_key_value_heads, _head_dim(text_config)
            attention = attention_strategy(text_config, cp, attention_cp)
            if attention == "kv_gather":
                per_layer = kv_gather_attention_bytes(seq_len, cp, q, kv, d, elem, recompute=recompute)
                strategy, comm = "all-gather K|V of the row, half the queries swapped per rank pair", "all_gather"
            elif attention == "kv_ring":
                per_layer = kv_ring_attention_bytes(seq_len, cp, q, kv, d, elem, recompute=recompute)
                strategy, comm = "ring of K|V blocks, query halves swapped", "ring"
            else:
                per_layer = ulysses_attention_bytes(seq_len, cp, q, kv, d, elem, recompute=recompute)
                strategy, comm = f"Ulysses all-to-all, KV heads x{max(1, cp // kv)}", "all_to_all"
        elif kind == "gdn":
            per_layer = gdn_bytes(text_config, seq_len, cp, elem, recompute=recompute)
            strategy, comm = "conv halo + delta-rule state passing", "state_passing"
        elif kind == "mamba":
            per_layer = mamba_bytes(text_config, style, seq_len, cp, elem, recompute=recompute)
            if style == "a2a":
                g = text_config.n_groups
                groups = f", n_groups {g} -> {max(g, cp)} replicated" if g < cp else ""
                strategy, comm = f"head-parallel all-to-all{groups}", "all_to_all"
            else:
                strategy, comm = "conv halo + SSD state passing", "state_passing"
        else:
            per_layer, strategy = 0, "local (token-wise, no CP traffic)"
        if cp == 1 and comm != "none":
            strategy = f"{strategy} (inactive at cp=1)"
        rows.append(
            dict(
                kind=kind,
                layer_type=layer_type,
                name=name,
                count=count,
                strategy=strategy,
                comm=comm if cp > 1 else "none",
                bytes_per_layer=per_layer,
                bytes=per_layer * count,
                saved_bytes_per_token=per_token[kind]["saved"],
            )
        )
    return rows


def build_plan(cfg, *, gpu_memory_gib: float | None = None, nvlink_gbps: float = NVLINK_GBPS) -> dict[str, Any]:
    """The plan of a validated :class:`~sft_trainer.config.TrainConfig` as a JSON-able dict (``sft-train plan
    --json`` prints it)."""
    from sft_trainer.config import model_family

    text, vision, notes = _text_config_of(cfg)
    family = model_family(text)
    style = cfg.parallel.resolve_cp_style(family)
    mamba_style = style if family == "nemotron_h" else "state_passing"
    attention_cp = cfg.parallel.attention_cp
    dp, cp = cfg.parallel.world_layout()
    seq_len = cfg.data.seq_len
    dtype = cfg.model.dtype
    elem = DTYPE_BYTES[dtype]
    ckpt = cfg.model.activation_checkpointing
    gpu = _default_gpu_gib() if gpu_memory_gib is None else gpu_memory_gib
    lora = cfg.train.lora

    def memory_kwargs(cp_: int, checkpointing: bool) -> dict[str, Any]:
        return dict(
            activation_checkpointing=checkpointing,
            dtype=dtype,
            optimizer=True,
            fsdp_world=dp * cp_,
            fsdp=cfg.parallel.fsdp,
            lora=lora.enabled,
            lora_targets=lora.targets,
            lora_rank=lora.rank,
            mamba_cp_style=mamba_style,
            vision_parameters=vision,
            attention_cp=attention_cp,
        )

    params = count_parameters(
        text, lora_targets=lora.targets if lora.enabled else None, lora_rank=lora.rank, vision=vision
    )
    memory = {
        name: estimate_memory(text, seq_len, cp, **memory_kwargs(cp, flag))
        for name, flag in (("no_checkpointing", False), ("checkpointing", True))
    }
    chosen = memory["checkpointing" if ckpt else "no_checkpointing"]
    rows = _layer_rows(text, seq_len, cp, mamba_style, elem, ckpt, chosen.per_token, attention_cp)
    total = sum(r["bytes"] for r in rows)
    kinds = ("state_passing", "all_to_all", "all_gather", "ring")
    shares = {kind: sum(r["bytes"] for r in rows if r["comm"] == kind) for kind in kinds}

    longest = {}
    for cp_ in sorted({*PLANNED_CPS, cp}):
        reason = valid_cp(text, cp_, mamba_style, attention_cp)
        entry: dict[str, Any] = {"cp": cp_, "valid": reason is None}
        if reason is None:
            for name, flag in (("no_checkpointing", False), ("checkpointing", True)):
                entry[name] = longest_seq_len(text, cp_, gpu, **memory_kwargs(cp_, flag))
        else:
            entry["reason"] = reason
        longest[cp_] = entry

    problems = []
    if chosen.needed > gpu * GIB:
        problems.append(
            _does_not_fit(text, cfg, dp, cp, gpu, chosen, memory_kwargs, longest, mamba_style, attention_cp)
        )
    return {
        "model": {
            "source": _source(cfg),
            "model_type": text.model_type,
            "family": family,
            "parameters": params.total,
            "parameters_by_kind": params.layers,
            "embeddings_parameters": params.embeddings,
            "trainable_parameters": params.trainable,
            "vision_parameters": vision,
        },
        "run": {
            "seq_len": seq_len,
            "cp": cp,
            "dp": dp,
            "local_tokens": seq_len // cp,
            "dtype": dtype,
            "cp_style": style,
            "attention_cp": attention_cp,
            "attention_strategy": attention_strategy(text, cp, attention_cp),
            "fsdp": cfg.parallel.fsdp,
            "fsdp_world": dp * cp if cfg.parallel.fsdp else 1,
            "activation_checkpointing": ckpt,
            "lora": lora.enabled,
            "grad_accum": cfg.train.grad_accum,
        },
        "layers": rows,
        "communication": {
            "bytes_per_row": total,
            "bytes_per_step": total * cfg.train.grad_accum * cfg.train.micro_batch_size,
            **{f"{kind}_bytes": shares[kind] for kind in kinds},
            **{f"{kind}_share": shares[kind] / total if total else 0.0 for kind in kinds},
            "nvlink_gbps": nvlink_gbps,
            "time_ms_per_row": total / (nvlink_gbps * 1e9) * 1e3,
            "recompute_included": ckpt,
        },
        "memory": {name: {**m.gib(), "local_tokens": m.local_tokens} for name, m in memory.items()},
        "gpu_memory_gib": gpu,
        "fits": not problems,
        "longest_seq_len": {str(k): v for k, v in longest.items()},
        "problems": problems,
        "notes": notes,
        "data": _data_packing(cfg),
    }


def _data_packing(cfg) -> dict[str, Any]:
    """The packing of the run's data from the token cache (``{"cached": False, ...}`` before a run has built it;
    ``{"error": ...}`` when the data or tokenizer cannot be read, which the run itself will report)."""
    from transformers import AutoTokenizer

    from sft_trainer.data import store_options
    from sft_trainer.data.lookup import locate_store

    try:
        tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer_path)
        processor = None
        if cfg.vision_language and cfg.processor_path:
            from sft_trainer.data import load_image_processor

            processor = load_image_processor(cfg.processor_path)
        return locate_store(
            cfg.data_path, tokenizer, cfg.data.seq_len, image_processor=processor, **store_options(cfg.data)
        ).packing()
    except Exception as exc:  # the run reports data problems with their file and row; the plan only notes them
        return {"error": f"{type(exc).__name__}: {exc}"}


def _source(cfg) -> str:
    m = cfg.model
    return m.path or m.config or m.preset or "?"


def _does_not_fit(text, cfg, dp, cp, gpu, chosen, memory_kwargs, longest, style, attention_cp) -> str:
    seq_len, ckpt = cfg.data.seq_len, cfg.model.activation_checkpointing
    fixes = []
    if not ckpt:
        with_ckpt = estimate_memory(text, seq_len, cp, **memory_kwargs(cp, True))
        if with_ckpt.needed <= gpu * GIB:
            fixes.append(f"enable model.activation_checkpointing (then {with_ckpt.needed / GIB:.1f} GiB)")
    if cp > 1 and attention_strategy(text, cp, attention_cp) == "kv_gather":
        ring = estimate_memory(text, seq_len, cp, **{**memory_kwargs(cp, ckpt), "attention_cp": "kv_ring"})
        if ring.needed <= gpu * GIB:
            fixes.append(f"set parallel.attention_cp = 'kv_ring' (then {ring.needed / GIB:.1f} GiB)")
    for cp_ in range(cp + 1, 257):
        if seq_len % cp_ or seq_len < _min_seq_len(text, cp_, style) or valid_cp(text, cp_, style, attention_cp):
            continue
        m = estimate_memory(text, seq_len, cp_, **memory_kwargs(cp_, ckpt))
        if m.needed <= gpu * GIB:
            fixes.append(f"raise parallel.cp to {cp_} (then {m.needed / GIB:.1f} GiB)")
            break
    if not fixes:  # no single change fits: the smallest cp that fits with checkpointing and/or the ring
        fixes.extend(_combined_fix(text, seq_len, cp, ckpt, gpu, memory_kwargs, style, attention_cp))
    best = longest[cp]["checkpointing" if ckpt else "no_checkpointing"]
    if best:
        fixes.append(f"lower data.seq_len to {best}")
    if not fixes:
        fixed = (chosen.parameters + chosen.gradients + chosen.optimizer) / GIB
        fixes.append(
            f"nothing at this layout fits (parameters, gradients and optimizer state alone need {fixed:.1f} GiB): "
            "use more ranks with parallel.fsdp = true, or train.lora"
        )
    return (
        f"data.seq_len={seq_len} at parallel.cp={cp} does not fit: needs {chosen.needed / GIB:.1f} GiB per rank, "
        f"the GPU has {gpu:.1f} GiB; " + " / ".join(fixes)
    )


def _combined_fix(text, seq_len, cp, ckpt, gpu, memory_kwargs, style, attention_cp) -> list[str]:
    """The first layout that fits when no single change does: the smallest cp (this one or more) with activation
    checkpointing and/or ring attention, fewest changes first; [] if none up to cp 256."""
    for cp_ in range(cp, 257):
        if seq_len % cp_ or seq_len < _min_seq_len(text, cp_, style):
            continue
        options = [
            (ckpt_, attention) for ckpt_ in dict.fromkeys((ckpt, True)) for attention in (attention_cp, "kv_ring")
        ]
        for ckpt_, attention in sorted(options, key=lambda o: (o[0] != ckpt) + (o[1] != attention_cp)):
            changes = [
                *(["enable model.activation_checkpointing"] if ckpt_ != ckpt else []),
                *([f"set parallel.attention_cp = '{attention}'"] if attention != attention_cp else []),
                *([f"raise parallel.cp to {cp_}"] if cp_ != cp else []),
            ]
            if len(changes) < 2 or valid_cp(text, cp_, style, attention):
                continue  # single changes were tried already
            kwargs = {**memory_kwargs(cp_, ckpt_), "attention_cp": attention}
            needed = estimate_memory(text, seq_len, cp_, **kwargs).needed
            if needed <= gpu * GIB:
                return [" and ".join(changes) + f" (then {needed / GIB:.1f} GiB)"]
    return []
