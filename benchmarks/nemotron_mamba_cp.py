"""Nemotron-H Nano Mamba-2 layer under CP: bytes per rank (state passing vs a2a) and one-GPU speed of a rank's share.

    uv run python benchmarks/nemotron_mamba_cp.py bytes          # CPU; writes docs/benchmarks/nemotron_mamba_cp_bytes.md
    python benchmarks/nemotron_mamba_cp.py speed --out DIR       # one CUDA GPU; writes DIR/nemotron_mamba_cp_speed.{md,json}
    uv run python benchmarks/nemotron_mamba_cp.py speed --device cpu --tiny   # CPU smoke run of the speed code path

bytes: one ``cp_models.nemotron_h.NemotronHMamba2Mixer`` (Nano widths: 64 heads x 64, n_groups 8, state 128, conv 4;
bf16 parameters and activations) runs forward + backward as one rank of a ``fake`` process group (true shapes,
meaningless data) under ``cp_core.testing.CommCounter``, for one document spanning the whole row (the worst case
for state passing: every rank passes state and halo), taking the largest count over the ranks. Two tiers:

- exact layer: the unmodified mixer, every rank, at a short row (16 tokens a rank), hidden 2688;
- table rows (8k, 32k, 128k): the same mixer and the same collectives (``causal_conv1d_cp``'s halo exchange,
  ``ssd_cp``'s state passing, ``fused_sequence_to_heads`` / ``heads_to_sequence``) with two things shrunk that never
  travel: hidden_size (only the input width of in_proj and output width of out_proj) and the local arithmetic of the
  conv and the scan (``cp_core.conv.causal_conv1d_torch`` and ``cp_core.ssd.chunk_ssd_torch`` swapped for
  stand-ins returning the same shapes and dtypes); the torch CPU path of the real scan is far too slow at 128k.
  Both tiers must agree at the short row, and every row must equal the closed form of docs/cp-models.md.
speed: forward + backward of one rank's share on one GPU (the real mixer on a fake process group, so the
collectives cost nothing and their bytes are added as bytes / link bandwidth). The whole-model comparison with
transformers is benchmarks/model_step.py (shape nemotron_h-nano-8l).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

DOCS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks"
NVLINK_GBPS = 450.0  # H200 NVLink 4, stated per-direction bandwidth, GB/s (1e9 bytes)
STYLES = ("state_passing", "a2a")

# Nemotron-H Nano-30B-A3B (public config; /work/shared/REFERENCE.md). Mamba-2 widths are what the bytes depend on.
NANO = dict(
    vocab_size=131072,
    hidden_size=2688,
    intermediate_size=1856,
    mamba_num_heads=64,
    mamba_head_dim=64,
    n_groups=8,
    ssm_state_size=128,
    conv_kernel=4,
    num_attention_heads=32,
    num_key_value_heads=2,
    head_dim=128,
    n_routed_experts=128,
    num_experts_per_tok=6,
    moe_intermediate_size=1856,
    moe_shared_expert_intermediate_size=3712,
    routed_scaling_factor=2.5,
)
TINY = dict(
    NANO,
    vocab_size=256,
    hidden_size=64,
    intermediate_size=32,
    mamba_num_heads=8,
    mamba_head_dim=8,
    n_groups=8,
    ssm_state_size=16,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    moe_shared_expert_intermediate_size=32,
)


def make_config(pattern: str = "M", **overrides):
    from transformers import NemotronHConfig

    return NemotronHConfig(**{**NANO, "hybrid_override_pattern": pattern, **overrides})


# --------------------------------------------------------------------------------------------------------------
# bytes


def closed_form(config, style: str, seq_len: int, cp: int, elem: int = 2) -> int:
    """docs/cp-models.md, Nemotron-H section, for the worst rank of one document spanning the row (the planner's)."""
    from sft_trainer.plan import mamba_bytes

    return mamba_bytes(config, style, seq_len, cp, elem)


def _stand_in_conv(x, weight, bias, activation, position_ids, halo=None):
    """Shape/dtype-preserving stand-in for causal_conv1d_torch; keeps the halo in the graph (its gradient travels)."""
    y = x * weight[:, -1]
    if bias is not None:
        y = y + bias
    if halo is not None:
        y = y + (halo * weight[:, 0]).sum(0)
    return F.silu(y) if activation == "silu" else y


def _stand_in_ssd(x, dt, A, B, C, *, seq_lens, D=None, initial_state=None, chunk_size=64):
    """Shape/dtype-preserving stand-in for chunk_ssd_torch: y [T, H, P] in x's dtype, fp32 final states."""
    heads = x.size(1)
    xf, bf = x.float(), B.float().repeat_interleave(heads // B.size(1), dim=1)
    y = xf * (dt.float() * A.float())[..., None] + C.float().sum(-1).mean(-1)[:, None, None]
    if D is not None:
        y = y + D.float()[:, None] * xf
    final = (xf.sum(0)[:, :, None] * bf.sum(0)[:, None, :]).unsqueeze(0)  # [1, H, P, N]
    return y.to(x.dtype), final.expand(len(seq_lens), -1, -1, -1)


@contextlib.contextmanager
def reduced_compute():
    """Swap the local conv and scan arithmetic for stand-ins; every collective stays the model's own."""
    conv, ssd = importlib.import_module("cp_core.conv"), importlib.import_module("cp_core.ssd")
    saved = conv.causal_conv1d_torch, ssd.chunk_ssd_torch
    conv.causal_conv1d_torch, ssd.chunk_ssd_torch = _stand_in_conv, _stand_in_ssd
    try:
        yield
    finally:
        conv.causal_conv1d_torch, ssd.chunk_ssd_torch = saved


def layer_bytes(config, style: str, seq_len: int, cp: int, rank: int) -> tuple[int, int]:
    """(bytes sent, collectives) by ``rank`` for one Mamba layer, forward + backward, one document of seq_len."""
    from cp_core import CPTopology, build_packed_metadata
    from cp_core.testing import CommCounter, fake_process_group
    from cp_models import set_context_parallel_attributes
    from cp_models.nemotron_h_mamba import NemotronHMamba2Mixer

    with fake_process_group(rank, cp) as group:
        torch.manual_seed(0)
        mixer = NemotronHMamba2Mixer(config, recurrent_backend="torch", cp_style=style).to(torch.bfloat16)
        set_context_parallel_attributes(mixer, CPTopology.from_group(group))
        meta = build_packed_metadata([seq_len], rank, cp)
        hidden = torch.zeros(seq_len // cp, config.hidden_size, dtype=torch.bfloat16, requires_grad=True)
        with CommCounter(cp) as counter:
            mixer(hidden, meta).float().sum().backward()
        return counter.total_sent_bytes, len(counter.records)


def worst_rank_bytes(config, style: str, seq_len: int, cp: int, ranks) -> tuple[int, int]:
    return max(layer_bytes(config, style, seq_len, cp, r) for r in ranks)


def run_bytes(
    seq_lens: list[int], cps: list[int], n_groups: list[int], out: Path, small_hidden: int, check_tokens: int
) -> None:
    variants = [(f"n_groups={g}", make_config(n_groups=g)) for g in n_groups]
    rows = []
    for label, config in variants:
        reduced = make_config(n_groups=config.n_groups, hidden_size=small_hidden)
        for style in STYLES:
            for cp in cps:
                # Exact layer vs reduced compute at a short row, every rank.
                short = check_tokens * cp
                exact = worst_rank_bytes(config, style, short, cp, range(cp))
                with reduced_compute():
                    cheap = worst_rank_bytes(reduced, style, short, cp, range(cp))
                if exact != cheap:
                    raise SystemExit(f"{label} {style} cp={cp}: exact layer {exact} vs reduced compute {cheap}")
                if exact[0] != closed_form(config, style, short, cp):
                    raise SystemExit(f"{label} {style} cp={cp} S={short}: {exact[0]} != closed form")
                # Worst rank: a2a is symmetric (rank 0); state passing's interior rank 1 (the last rank at cp = 2).
                rank = 0 if style == "a2a" else min(1, cp - 1)
                for seq_len in seq_lens:
                    with reduced_compute():
                        sent, collectives = layer_bytes(reduced, style, seq_len, cp, rank)
                    formula = closed_form(config, style, seq_len, cp)
                    print(
                        f"{label:40s} {style:13s} S={seq_len:7d} cp={cp}: measured {sent:11d} B, "
                        f"closed form {formula:11d} B, {collectives} collectives"
                        f"{'' if sent == formula else '  MISMATCH'}",
                        flush=True,
                    )
                    if sent != formula:
                        raise SystemExit("measured bytes differ from the closed form")
                    rows.append((label, style, seq_len, cp, sent, collectives))
        _write_bytes_doc(rows, out, seq_lens, cps, small_hidden, check_tokens)  # after each variant


def _write_bytes_doc(rows, out: Path, seq_lens, cps, small_hidden: int, check_tokens: int) -> None:
    by_key = {(lab, st, s, cp): b for lab, st, s, cp, b, _ in rows}
    lines = [
        "# Nemotron-H Nano Mamba-2 layer under CP: bytes sent per rank (forward + backward)",
        "",
        "One `cp_models.nemotron_h.NemotronHMamba2Mixer` of the Nemotron-H Nano-30B-A3B shape (hidden 2688,",
        "64 heads x 64, n_groups 8, state 128, conv 4), bf16 parameters and activations, run forward + backward as",
        "one rank of a `fake` process group (true shapes, meaningless data); bytes counted by",
        "`cp_core.testing.CommCounter` from the tensors handed to the collectives. **One document spans the whole",
        "row** (worst case for state passing: every shard cut falls inside the document, so every rank passes the",
        "conv halo and the SSD state). Largest count over the ranks: state passing's interior ranks send a halo and",
        "a state forward and their gradients backward; at cp = 2 each rank sends only one of the two.",
        "",
        "How the rows were obtained (CPU, no invented numbers):",
        "",
        f"- At a short row ({check_tokens} tokens a rank) the **unmodified** mixer at hidden 2688 ran on every rank",
        "  for every cp and both strategies.",
        "- The 8k / 32k / 128k rows ran the same mixer code and the same collectives (`causal_conv1d_cp`'s halo",
        "  exchange, `ssd_cp`'s state passing, `fused_sequence_to_heads` and `heads_to_sequence`), at the worst rank,",
        f"  with two things shrunk that never travel: `hidden_size` {small_hidden} instead of 2688 (the input width of",
        "  `in_proj` and output width of `out_proj` only; x|B|C, dt, z, y keep their Nano widths) and the local",
        "  arithmetic of the conv and the SSD scan (`cp_core.conv.causal_conv1d_torch`, `cp_core.ssd.chunk_ssd_torch`",
        "  swapped for stand-ins returning the same shapes and dtypes, with the halo kept in the graph). The torch",
        "  CPU path is far too slow for 128k (the exact layer did not finish 8k at cp = 2 in 10 minutes).",
        "- The two tiers gave identical bytes and collective counts at the short row, every row equals the closed",
        "  form of docs/cp-models.md (Nemotron-H section; checked by the script, which stops on any difference):",
        "  state passing `2 ((W-1)(HP + 2GN) b + 4HPN)` (half at cp = 2), a2a `2 T (2HP + 2G'N + H) b (cp-1)/cp`,",
        "  `T = S/cp`, `G' = max(n_groups, cp)`, `b = 2` (bf16), states fp32.",
        f"- est. comm time = bytes / {NVLINK_GBPS:.0f} GB/s (H200 NVLink 4 stated per-direction bandwidth, 1 GB = 1e9",
        "  bytes); a lower bound: no latency, no overlap, and state passing's hops are sequential along the chain.",
        "",
        "Reproduce: `uv run python benchmarks/nemotron_mamba_cp.py bytes`",
        "",
        "| groups | strategy | S | cp | bytes per rank (fwd+bwd) | MiB | est. comm time (ms) |",
        "|---|---|---|---|---|---|---|",
    ]
    for lab, st, s, cp, b, _ in rows:
        lines.append(f"| {lab} | {st} | {s} | {cp} | {b} | {b / 2**20:.2f} | {b / NVLINK_GBPS / 1e6:.4f} |")
    lines += ["", "Ratio state_passing / a2a (n_groups = 8):", "", "| S | " + " | ".join(f"cp={c}" for c in cps) + " |"]
    lines.append("|---|" + "---|" * len(cps))
    for s in seq_lens:
        cells = []
        for c in cps:
            sp, a2a = by_key.get(("n_groups=8", "state_passing", s, c)), by_key.get(("n_groups=8", "a2a", s, c))
            cells.append(f"{sp / a2a:.2%}" if sp and a2a else "-")
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Reading (n_groups = 8): state passing sends a fixed amount per layer whatever S, one fp32 state",
        "`[64, 64, 128]` (2 MiB) plus a 3-row bf16 conv halo (36 KiB) each way: about 2.04 MiB at cp = 2 (each rank",
        "sends one direction), 4.07 MiB at cp >= 4 (interior ranks send both). The a2a sends (cp-1)/cp of x|B|C|dt",
        "and of y for its S/cp tokens, forward and backward, so it grows linearly with S and shrinks with cp.",
    ]
    for s in seq_lens:
        ratios = [
            by_key[("n_groups=8", "state_passing", s, c)] / by_key[("n_groups=8", "a2a", s, c)]
            for c in cps
            if ("n_groups=8", "state_passing", s, c) in by_key and ("n_groups=8", "a2a", s, c) in by_key
        ]
        if ratios:
            lines.append(f"At S = {s}: state passing is {min(ratios):.2%} to {max(ratios):.2%} of the a2a bytes.")
    big = [
        (c, b) for (lab, st, s, c), b in by_key.items() if lab == "n_groups=8" and st == "a2a" and s == max(seq_lens)
    ]
    for c, b in sorted(big)[:1]:
        lines.append(
            f"Largest a2a: {b / 2**30:.2f} GiB per layer per rank at S = {max(seq_lens)}, cp = {c} "
            f"(~{b / NVLINK_GBPS / 1e6:.1f} ms at {NVLINK_GBPS:.0f} GB/s; Nano has 23 Mamba layers)."
        )
    lines += [
        "State passing's cost is latency rather than bytes: a document spanning k ranks makes k-1 sequential hops",
        "(forward and again backward), which this table does not show.",
    ]
    if any(lab == "n_groups=2" for lab, *_ in rows):
        lines += [
            "With n_groups = 2 the a2a replicates B and C up to cp groups (G' = max(n_groups, cp)): fewer bytes than",
            "n_groups = 8 at cp = 2 and 4, the same at cp = 8; state passing's halo is slightly smaller.",
        ]
    out.mkdir(parents=True, exist_ok=True)
    target = out / "nemotron_mamba_cp_bytes.md"
    target.write_text("\n".join(lines) + "\n")
    print(f"wrote {target}")


# --------------------------------------------------------------------------------------------------------------
# speed


class _Timer:
    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def peak_gib(self) -> float:
        return torch.cuda.max_memory_allocated() / 2**30 if self.cuda else float("nan")


def _median_ms(step, timer: _Timer, reps: int, warmup: int = 2) -> tuple[float, float]:
    times = []
    for i in range(reps + warmup):
        timer.sync()
        if i == warmup:
            timer.reset_peak()
        start = time.perf_counter()
        step()
        timer.sync()
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1000)
    return sorted(times)[len(times) // 2], timer.peak_gib()


@contextlib.contextmanager
def _layer_share_step(config, style: str, seq_len: int, cp: int, device: str):
    """Yields forward + backward of one rank's share of one Mamba layer: the real mixer as rank min(1, cp-1) of a
    fake process group (state passing: S/cp tokens incl. halo, correction and pre/post work; a2a: in_proj/norm/
    out_proj on S/cp tokens, conv + scan on S tokens for H/cp heads). Collectives are free here."""
    from cp_core import CPTopology, build_packed_metadata
    from cp_core.testing import fake_process_group
    from cp_models import set_context_parallel_attributes
    from cp_models.nemotron_h_mamba import NemotronHMamba2Mixer

    rank = min(1, cp - 1)
    with fake_process_group(rank, cp) as group:
        torch.manual_seed(0)
        mixer = NemotronHMamba2Mixer(config, cp_style=style).to(device=device, dtype=torch.bfloat16)
        if cp > 1:
            set_context_parallel_attributes(mixer, CPTopology.from_group(group))
        meta = build_packed_metadata([seq_len], rank, cp)
        hidden = torch.randn(seq_len // cp, config.hidden_size, device=device, dtype=torch.bfloat16)
        hidden.requires_grad_(True)
        grad = torch.randn_like(hidden)

        def step():
            mixer.zero_grad(set_to_none=True)
            hidden.grad = None
            mixer(hidden, meta).backward(grad)

        yield step


def layer_share_ms(config, style: str, seq_len: int, cp: int, device: str, reps: int) -> tuple[float, float]:
    """(median ms, peak GiB) of one rank's share (see ``_layer_share_step``)."""
    with _layer_share_step(config, style, seq_len, cp, device) as step:
        return _median_ms(step, _Timer(device), reps)


def layer_share_profile(config, style: str, seq_len: int, cp: int, device: str) -> str:
    """torch.profiler's table (top ops by self device time) of one step of a rank's share, after a warm-up."""
    with _layer_share_step(config, style, seq_len, cp, device) as step:
        _median_ms(step, _Timer(device), reps=1)  # compile and warm up outside the trace
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.startswith("cuda"):
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            step()
            _Timer(device).sync()
    sort = "self_cuda_time_total" if device.startswith("cuda") else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=sort, row_limit=25, max_name_column_width=60)


def _layer_config(tiny: bool):
    """A one-layer ("M") config of the Nano widths, or of the tiny ones."""
    base = TINY if tiny else NANO
    return base, make_config("M", **{k: v for k, v in base.items() if k not in NANO or NANO[k] != v})


def run_profile(args) -> None:
    """Profiles of one step per case (state passing at cp 1 and 2, a2a at cp 2), to find where time goes."""
    _, config = _layer_config(args.tiny)
    seq_len = args.profile
    lines = [f"# Nemotron-H Nano Mamba-2 layer profiles (S = {seq_len}, one rank's share, fake process group)", ""]
    for style, cp in (("state_passing", 1), ("state_passing", 2), ("a2a", 2)):
        table = layer_share_profile(config, style, seq_len, cp, args.device)
        lines += [f"## {style}, cp = {cp}", "", "```", table, "```", ""]
        print(lines[-4][:3000], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "nemotron_mamba_cp_profile.md").write_text("\n".join(lines))


def run_speed(args) -> None:
    base, layer_config = _layer_config(args.tiny)
    seq_lens = args.seq_lens or ([256, 512] if args.tiny else [8192, 32768, 131072])
    cps = [c for c in (1, 2, 4, 8) if base["mamba_num_heads"] % c == 0]
    reps = 1 if args.tiny else args.reps
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    layer_rows, warmed = [], set()
    # cp-major, so that a run cut short still compares the strategies at the smaller cp; at cp = 1 both are the
    # same unsharded layer (the mixer takes its a2a branch only with CP enabled), so it runs once.
    order = [(st, c, s) for c in cps for st in (STYLES if c > 1 else STYLES[:1]) for s in seq_lens]
    for style, cp, seq_len in order:
        if (style, cp) not in warmed:  # compile + autotune on a short row (each length then gets 2 warm-up steps)
            layer_share_ms(layer_config, style, min(seq_lens), cp, args.device, reps=1)
            warmed.add((style, cp))
        ms, peak = layer_share_ms(layer_config, style, seq_len, cp, args.device, reps)
        comm = closed_form(layer_config, style, seq_len, cp) if cp > 1 else 0
        comm_ms = comm / NVLINK_GBPS / 1e6
        row = dict(style=style, seq_len=seq_len, cp=cp, compute_ms=ms, peak_gib=peak, bytes=comm, comm_ms=comm_ms)
        row["est_total_ms"] = ms + comm_ms
        layer_rows.append(row)
        print(row, flush=True)
        _write_speed_table(layer_rows, seq_lens, reps, device_name, args.out)  # a run cut short keeps its rows


def _write_speed_table(layer_rows: list[dict], seq_lens, reps: int, device_name: str, out: Path) -> None:
    lines = [
        f"# Nemotron-H Nano Mamba-2 under CP: one rank's share on one device ({device_name}, bf16)",
        "",
        f"S = {', '.join(map(str, seq_lens))} tokens, one document. Layer rows: forward + backward of the real `NemotronHMamba2Mixer` as",
        "one rank of a `fake` process group (its collectives cost nothing here): state passing runs S/cp tokens",
        "(conv halo, SSD correction, in_proj / gated norm / out_proj included), a2a runs in_proj, norm and out_proj",
        "on S/cp tokens and conv + scan on S tokens for 64/cp heads. est. comm = closed-form bytes (measured equal",
        f"in the bytes mode) / {NVLINK_GBPS:.0f} GB/s; est. total = compute + comm, no overlap, no latency.",
        f"Median of {reps} after 2 warm-ups (and one short warm-up row per strategy and cp for compilation).",
        "",
        f"Reproduce: `python benchmarks/nemotron_mamba_cp.py speed --reps {reps} --out DIR`",
        "",
        "| strategy | S | cp | compute ms | peak GiB | MiB sent | est. comm ms | est. total ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in layer_rows:
        lines.append(
            f"| {r['style'] if r['cp'] > 1 else 'either (unsharded)'} | {r['seq_len']} | {r['cp']} | {r['compute_ms']:.2f} | {r['peak_gib']:.2f} | {r['bytes'] / 2**20:.2f} "
            f"| {r['comm_ms']:.3f} | {r['est_total_ms']:.2f} |"
        )
    unsharded = {r["seq_len"]: r["compute_ms"] for r in layer_rows if r["cp"] == 1}
    shares = [r for r in layer_rows if r["cp"] > 1 and r["seq_len"] in unsharded]
    if shares:
        lines += [
            "",
            "Compute of a rank's share vs the ideal (the unsharded layer's time at the same S / cp):",
            "",
            "| S | cp | state passing / ideal | a2a / ideal | faster (est. total) |",
            "|---|---|---|---|---|",
        ]
        for seq_len, cp in sorted({(r["seq_len"], r["cp"]) for r in shares}):
            by = {r["style"]: r for r in shares if (r["seq_len"], r["cp"]) == (seq_len, cp)}
            ideal = unsharded[seq_len] / cp
            ratio = [f"{by[st]['compute_ms'] / ideal:.2f}" if st in by else "-" for st in STYLES]
            faster = min(by, key=lambda st: by[st]["est_total_ms"]) if len(by) == 2 else "-"
            lines.append(f"| {seq_len} | {cp} | {ratio[0]} | {ratio[1]} | {faster} |")
    lines += [
        "",
        "The whole model (Nano widths, first 8 layers) against transformers' NemotronHForCausalLM in the same run:",
        "[model_step.md](model_step.md), shape `nemotron_h-nano-8l`.",
    ]
    out.mkdir(parents=True, exist_ok=True)
    (out / "nemotron_mamba_cp_speed.md").write_text("\n".join(lines) + "\n")
    (out / "nemotron_mamba_cp_speed.json").write_text(
        json.dumps({"device": device_name, "layer": layer_rows}, indent=1)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    b = sub.add_parser("bytes", help="count bytes per rank on CPU (fake process group)")
    b.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 32768, 131072])
    b.add_argument("--cps", type=int, nargs="+", default=[2, 4, 8])
    b.add_argument(
        "--n-groups",
        type=int,
        nargs="+",
        default=[8],
        help="B/C groups (Nano: 8; add 2 for replicated groups, ~25 min more on 2 CPU cores)",
    )
    b.add_argument("--out", type=Path, default=DOCS)
    b.add_argument("--small-hidden", type=int, default=1, help="hidden_size of the reduced-compute rows")
    b.add_argument("--check-tokens", type=int, default=16, help="tokens a rank in the exact-layer check")
    s = sub.add_parser("speed", help="one-GPU time of a rank's share and a small Nano-shaped model")
    s.add_argument("--out", type=Path, default=Path("."))
    s.add_argument("--device", default="cuda")
    s.add_argument("--tiny", action="store_true", help="tiny widths and length (CPU debugging of this path)")
    s.add_argument("--seq-lens", type=int, nargs="+", default=None, help="default 8k 32k 128k (256 512 with --tiny)")
    s.add_argument("--reps", type=int, default=5)
    s.add_argument("--profile", type=int, default=None, metavar="S",
                   help="instead of the table: profile one step at S tokens (state passing cp 1 and 2, a2a cp 2)")  # fmt: skip
    args = parser.parse_args()
    if args.what == "bytes":
        run_bytes(args.seq_lens, args.cps, args.n_groups, args.out, args.small_hidden, args.check_tokens)
    elif args.profile:
        run_profile(args)
    else:
        run_speed(args)


if __name__ == "__main__":
    main()
