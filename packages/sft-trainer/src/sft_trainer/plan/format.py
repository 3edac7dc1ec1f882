"""The plan as the table ``sft-train plan`` prints."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sft_trainer.plan.coefficients import GIB


def format_size(nbytes: float) -> str:
    if nbytes == 0:
        return "0"
    for unit, scale in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"


def format_plan(plan: Mapping[str, Any]) -> str:
    """The plan as a plain-text report."""
    m, r, c = plan["model"], plan["run"], plan["communication"]
    out = []
    params = f"{m['parameters'] / 1e9:.3f}B parameters" if m["parameters"] >= 1e8 else f"{m['parameters']:,} parameters"
    trainable = f", {m['trainable_parameters']:,} trainable (LoRA)" if r["lora"] else ""
    out.append(f"sft-train plan: {m['source']} ({m['model_type']}), {params}{trainable}, {r['dtype']}")
    ranks = f"{r['fsdp_world']} rank{'s' if r['fsdp_world'] != 1 else ''}"
    layout = f"FSDP2 over {ranks}" if r["fsdp"] else "full replica per rank"
    out.append(
        f"  data.seq_len={r['seq_len']}, parallel.cp={r['cp']} ({r['local_tokens']} tokens a rank), dp={r['dp']}, "
        f"cp_style={r['cp_style']}, attention_cp={r['attention_cp']}"
        + (f" ({r['attention_strategy']})" if r["attention_strategy"] not in (None, r["attention_cp"]) else "")
        + f", {layout}, activation checkpointing {'on' if r['activation_checkpointing'] else 'off'}"
    )
    d = plan.get("data", {})
    if d.get("cached"):
        out.append(
            f"  data: {d['rows']} rows of {r['seq_len']} tokens, {d['documents']} documents, packing efficiency "
            f"{d['efficiency']:.2%} (padding {d['padding_tokens']} tokens; token cache {d['cache']})"
        )
    elif "cache" in d:
        out.append(
            f"  data: packing efficiency known once the token cache is built (the first run builds {d['cache']})"
        )
    elif "error" in d:
        out.append(f"  data: not read ({d['error']})")
    out.append("")
    out.append(
        f"CP traffic per rank for one row of {r['seq_len']} tokens, forward + backward (busiest rank, one document "
        f"spanning the row{'; recomputation re-sends the forward share' if c['recompute_included'] else ''})"
    )
    header = f"  {'layer type':42s} {'count':>5s}  {'CP strategy':48s} {'per layer':>11s} {'all layers':>11s} {'saved/token':>11s}"
    out.append(header)
    out.append("  " + "-" * (len(header) - 2))
    for row in plan["layers"]:
        label = f"{row['layer_type']} ({row['name']})"
        out.append(
            f"  {label:42s} {row['count']:5d}  {row['strategy']:48s} {format_size(row['bytes_per_layer']):>11s} "
            f"{format_size(row['bytes']):>11s} {format_size(row['saved_bytes_per_token']):>11s}"
        )
    total = c["bytes_per_row"]
    out.append(
        f"  total per row: {format_size(total)}; state passing {c['state_passing_share']:.1%}, all-to-all "
        f"{c['all_to_all_share']:.1%}, all-gather {c['all_gather_share']:.1%}, ring {c['ring_share']:.1%}; per "
        "optimizer step "
        f"({r['grad_accum']} rows): {format_size(c['bytes_per_step'])}"
    )
    out.append(
        f"  time at {c['nvlink_gbps']:.0f} GB/s NVLink: {c['time_ms_per_row']:.4g} ms per row (a lower bound: no "
        "latency, no overlap; state passing's hops are sequential)"
    )
    out.append("")
    mem = plan["memory"]
    out.append(f"Memory per rank (GiB), busiest rank, {r['local_tokens']} local tokens")
    out.append(f"  {'':52s} {'no checkpointing':>17s} {'checkpointing':>14s}")
    weights = "fp32 shards + gathered working copy" if r["fsdp"] else f"{r['dtype']} replica"
    labels = [
        ("parameters", f"parameters ({weights})"),
        ("gradients", "gradients" + (" (fp32 shards + unsharded in backward)" if r["fsdp"] else "")),
        ("optimizer", "optimizer state (AdamW exp_avg, exp_avg_sq)"),
        ("activations", "activations saved for backward"),
        ("workspace", "backward workspace (max of loss, largest layer)"),
        ("total", "total (torch.cuda.max_memory_allocated)"),
        ("headroom", "headroom (CUDA context, NCCL, fragmentation)"),
        ("needed", "needed"),
    ]
    for key, label in labels:
        a, b = mem["no_checkpointing"][key], mem["checkpointing"][key]
        out.append(f"  {label:52s} {a:17.2f} {b:14.2f}")
    for key, label in (("loss_workspace", "  of which loss"), ("layer_transient", "  of which largest layer")):
        a, b = mem["no_checkpointing"][key], mem["checkpointing"][key]
        out.append(f"  {label:52s} {a:17.2f} {b:14.2f}")
    out.append(f"  GPU: {plan['gpu_memory_gib']:.1f} GiB")
    out.append("")
    out.append(f"Longest data.seq_len that fits {plan['gpu_memory_gib']:.1f} GiB (a multiple of cp)")
    out.append(f"  {'cp':>4s} {'no checkpointing':>17s} {'checkpointing':>14s}")
    for key, entry in plan["longest_seq_len"].items():
        if entry["valid"]:
            mark = "  <- this run" if int(key) == r["cp"] else ""
            out.append(f"  {key:>4s} {entry['no_checkpointing']:17d} {entry['checkpointing']:14d}{mark}")
        else:
            out.append(f"  {key:>4s} {'not valid: ' + entry['reason']}")
    for note in plan["notes"]:
        out.append(f"note: {note}")
    if plan["problems"]:
        out.append("")
        out.extend(f"DOES NOT FIT: {p}" for p in plan["problems"])
    return "\n".join(out)
