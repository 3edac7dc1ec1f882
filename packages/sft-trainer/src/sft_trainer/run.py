"""Start and run a training job: local workers or torchrun, device mesh, model, data, loop, checkpoints."""

from __future__ import annotations

import os
import resource
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch.utils.data import Subset

from cp_core import CPTopology
from sft_trainer.checkpoint import check_resume, maybe_resume, resume_checkpoint, save_checkpoint
from sft_trainer.progress import Progress
from sft_trainer.report import write_report_at_end
from sft_trainer.run_folder import hold_run_folders, output_problems
from sft_trainer.train import MetricsWriter, StepStats, lr_lambda, train_step
from sft_trainer.watchdog import (
    collective_timeout,
    is_collective_timeout,
    peers_that_stopped,
    run_workers,
    start_beating,
    stop_watching,
    watch_peers,
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def world_layout(cfg) -> tuple[int, int]:
    """(dp, cp) for this run's world: torchrun's WORLD_SIZE, else the local worker count (dp = -1 takes the rest)."""
    world = int(os.environ.get("WORLD_SIZE", 0)) or cfg.parallel.num_local_workers
    return cfg.parallel.resolve_dp(world), cfg.parallel.cp


def launch(cfg) -> None:
    """Run under torchrun when its variables are set; otherwise spawn dp x cp local workers (CPU runs)."""
    if "RANK" in os.environ:
        run_worker_then_exit(cfg)
    dp, cp = world_layout(cfg)
    world = dp * cp
    # a worker that stops prints its message or traceback; the launcher adds which worker and how it ended
    run_workers(_spawned, (cfg, world, _free_port()), world, cfg.parallel.heartbeat_timeout_s)


def _spawned(rank: int, cfg, world: int, port: int, beats=None) -> None:
    if beats is not None:
        start_beating(beats, rank)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    run_worker_then_exit(cfg)


def run_worker_then_exit(cfg) -> NoReturn:
    """Run this process's worker, then end the process with its exit code (a spawned or a torchrun worker)."""
    # Every way out leaves without the interpreter's teardown: at finalization a gloo worker thread can still be
    # joinable, and about one run in ten then died with SIGABRT ("terminate called without an active exception"),
    # after finishing or after a clean one-line stop, so the launcher reported a crash instead of the stop. The
    # exit code and the message (or traceback) are kept; the launcher reports the code.
    code = 0
    try:
        worker(cfg)
    except SystemExit as exc:
        if isinstance(exc.code, int):
            code = exc.code
        elif exc.code is not None:  # SystemExit("message"): print it as the interpreter would, exit with 1
            print(exc.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:  # Ctrl-C reaches every worker: no traceback per process
        code = 130
    except BaseException as exc:
        if is_collective_timeout(exc):
            rank = os.environ.get("RANK", "?")
            print(
                f"sft-train: rank {rank}: a collective timed out after {cfg.parallel.collective_timeout_s:g} s "
                f"(parallel.collective_timeout_s): {peers_that_stopped()}",
                file=sys.stderr,
            )
        else:
            traceback.print_exc()
        code = 1
    stop_watching()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _device_and_backend(cfg) -> tuple[torch.device, str]:
    backend = _backend(cfg)
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        return torch.device("cuda", local), backend
    return torch.device("cpu"), backend


# VL config field -> the placeholder's name in sft_trainer.data.VisionTokens
VISION_TOKEN_FIELDS = {
    "image_token_id": "image_pad",
    "video_token_id": "video_pad",
    "vision_start_token_id": "vision_start",
    "vision_end_token_id": "vision_end",
}


def vision_token_ids(tokenizer) -> dict[str, int]:
    """The ids of Qwen3.5-VL's vision placeholder tokens in ``tokenizer`` (config field -> id), those it has."""
    from sft_trainer.data import VisionTokens

    ids = VisionTokens().ids(tokenizer)
    return {field: ids[name] for field, name in VISION_TOKEN_FIELDS.items() if name in ids}


def check_vision_tokens(hf_config, tokenizer) -> None:
    """A VL model's placeholder ids must be the tokenizer's (else images would land on the wrong tokens)."""
    from sft_trainer.data import VisionTokens

    ids = vision_token_ids(tokenizer)
    wrong = [
        f"{field}={getattr(hf_config, field)} but the tokenizer's "
        f"{getattr(VisionTokens(), VISION_TOKEN_FIELDS[field])} is {ids.get(field, 'absent')}"
        for field in ("image_token_id", "vision_start_token_id")
        if ids.get(field) != getattr(hf_config, field)
    ]
    if wrong:
        raise SystemExit(f"sft-train: the tokenizer does not match the VL model: {'; '.join(wrong)}")


def build_model(cfg, tokenizer, device: torch.device, mesh, topology: CPTopology):
    """The model, ready to train: built (or loaded), activation checkpointing, CP topology, LoRA, compile, FSDP2."""
    from cp_models import (
        NemotronHForCausalLM,
        Qwen35ForCausalLM,
        apply_activation_checkpointing,
        set_context_parallel_attributes,
    )
    from cp_vlm import Qwen35VLForConditionalGeneration
    from sft_trainer.config import is_vision_language, model_family, resolve_model_config
    from sft_trainer.parallelize import apply_compile, apply_fsdp

    compute_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.model.dtype]
    # FSDP keeps fp32 master weights and casts the gathered parameters; replicas are cast as a whole.
    storage_dtype = torch.float32 if cfg.parallel.fsdp else compute_dtype
    hf_config = resolve_model_config(cfg.model, vocab_size=len(tokenizer), token_ids=vision_token_ids(tokenizer))
    family = model_family(hf_config)
    vision = is_vision_language(hf_config)
    kwargs = dict(attention_backend=cfg.model.attention_backend, recurrent_backend=cfg.model.recurrent_backend)
    model_class = Qwen35ForCausalLM
    if family == "nemotron_h":
        model_class, kwargs["mamba_cp_style"] = NemotronHForCausalLM, cfg.parallel.resolve_cp_style(family)
    elif vision:
        check_vision_tokens(hf_config, tokenizer)
        model_class, kwargs["vision_cp"] = Qwen35VLForConditionalGeneration, cfg.model.vision_cp
    if cfg.model.path:
        try:
            model = model_class.from_pretrained(cfg.model.path, dtype=storage_dtype, **kwargs)
        except Exception as exc:  # missing, truncated or mis-shaped weights: alike on every rank
            _stop(dist.get_rank(), f"model.path={cfg.model.path!r} does not load: {_one_line(exc)}")
    else:  # random init from a config file or the preset (the preset takes the tokenizer's vocabulary)
        torch.manual_seed(cfg.train.seed)
        model = model_class(hf_config, **kwargs).to(storage_dtype)
    if cfg.model.activation_checkpointing:
        apply_activation_checkpointing(model)
        if vision:
            apply_activation_checkpointing(model, model.vision_blocks())
    set_context_parallel_attributes(
        model, topology.group, topology.rank, topology.size, attention_cp_style=cfg.parallel.attention_cp
    )
    if cfg.train.lora.enabled:
        from sft_trainer.lora import apply_lora

        lora = cfg.train.lora
        apply_lora(model, lora.targets, lora.rank, lora.alpha, lora.dropout, seed=cfg.train.seed)
    model = model.to(device)
    if cfg.model.compile:
        apply_compile(model)
    if cfg.parallel.fsdp:
        apply_fsdp(model, mesh, param_dtype=compute_dtype if compute_dtype != storage_dtype else None)
    return model


def _memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _one_line(exc: BaseException, limit: int = 600) -> str:
    """``Type: message`` of ``exc`` on one line, cut at ``limit`` characters."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _stop(rank: int, message: str) -> NoReturn:
    """End this worker over a user-facing problem every rank meets alike: one clean line from rank 0, no traceback.
    Rank 0 prints at once; the others wait a moment first, since the launcher stops every worker when one ends."""
    if rank == 0:
        print(f"sft-train: {message}", file=sys.stderr, flush=True)
    else:
        time.sleep(2.0)
    raise SystemExit(1) from None


def worker(cfg) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    from sft_trainer.data import DataError, build_training_rows
    from sft_trainer.lora import dropout_seed
    from sft_trainer.tokenizer_fit import load_tokenizer

    device, backend = _device_and_backend(cfg)
    dp, cp = world_layout(cfg)
    # the mesh's subgroups take torch's default timeout, not the default group's: set that one too
    dist.distributed_c10d.default_pg_timeout = dist.distributed_c10d.default_pg_nccl_timeout = collective_timeout(cfg)
    dist.init_process_group(backend, timeout=collective_timeout(cfg))
    try:
        rank = dist.get_rank()
        if "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun: no launcher of ours watches, the ranks watch each other
            watch_peers(rank, dist.get_world_size(), cfg.parallel.heartbeat_timeout_s)
        mesh = init_device_mesh(device.type, (dp, cp), mesh_dim_names=("dp", "cp"))
        topology = CPTopology.from_mesh(mesh, "cp")
        if rank == 0 and resume_checkpoint(cfg) is None:
            set_aside_previous_run(cfg)
        dist.barrier()  # before any rank reads or writes the run folder
        dp_group = mesh.get_group("dp")
        world_group = dist.group.WORLD
        try:
            tokenizer = load_tokenizer(cfg.tokenizer_path)
        except Exception as exc:
            _stop(rank, f"data.tokenizer={str(cfg.tokenizer_path)!r} does not load: {type(exc).__name__}: {exc}")
        image_processor = None
        if cfg.vision_language and cfg.processor_path:
            from sft_trainer.data import load_image_processor

            image_processor = load_image_processor(cfg.processor_path)
        try:  # the data first: its mistakes show in seconds, before any weight loads
            rows, data_stats = build_training_rows(cfg, tokenizer, image_processor=image_processor)
        except DataError as exc:
            _stop(rank, f"data.path={str(cfg.data_path)!r}: {exc}")
        except Exception as exc:
            # jinja2's TemplateError: the chat template fails to render, or its sandbox refuses what it does
            if type(exc).__module__.startswith("jinja2"):
                _stop(rank, f"data.tokenizer={str(cfg.tokenizer_path)!r}: its chat template fails: {_one_line(exc)}")
            raise
        if data_stats.loss_tokens == 0:
            _stop(
                rank,
                f"data.path={str(cfg.data_path)!r}: no packed row holds a loss token ({data_stats}); nothing would be "
                "learned: raise data.seq_len or check that the conversations have assistant replies",
            )
        model = build_model(cfg, tokenizer, device, mesh, topology)
        torch.manual_seed(dropout_seed(cfg.train.seed, rank))  # dropout's draws; restored instead on resume
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(
            params,
            lr=cfg.train.lr,
            betas=tuple(cfg.train.betas),
            weight_decay=cfg.train.weight_decay,
            fused=device.type == "cuda" or None,  # one kernel per step on GPUs; torch's default (foreach) on CPU
        )
        steps, warmup = cfg.train.steps, cfg.train.warmup_steps
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: lr_lambda(s, warmup, steps, cfg.train.decay, cfg.train.min_lr_ratio)
        )
        my_rows = Subset(rows, range(mesh.get_local_rank("dp"), len(rows), dp))  # rows are read when a step asks
        if not my_rows:
            raise SystemExit(f"no packed rows for dp rank {mesh.get_local_rank('dp')} ({len(rows)} rows for dp={dp})")
        out_dir = Path(cfg.output_dir)
        ckpt_dir = cfg.checkpoint_dir
        start_step = maybe_resume(cfg, model, optimizer, scheduler)
        metrics = MetricsWriter(cfg.metrics_path if rank == 0 else None, fresh=start_step == 0, resumed_at=start_step)
        wandb_run = start_wandb(cfg) if rank == 0 else None
        metrics.wandb_run = wandb_run
        if rank == 0:
            print(
                f"[sft-train] dp={dp} cp={cp} backend={backend} device={device.type}; "
                f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters; data: {data_stats}; packing "
                f"efficiency {rows.efficiency:.2%} (document tokens / row tokens)",
                flush=True,
            )
        losses = []
        per_step = cfg.train.grad_accum

        def run_state(done: int) -> dict[str, int]:  # what a resume must match, and where this rank's data stands
            return {
                "train_steps": steps,
                "grad_accum": per_step,
                "data_position": done * per_step,
                "world_size": dp * cp,
            }

        nonfinite = 0  # consecutive skipped steps
        if rank == 0:
            progress = Progress(steps, start_step, cfg.logging.log_every, cfg.logging.progress_bar)
        for step in range(start_step, steps):
            batch = [my_rows[(step * per_step + i) % len(my_rows)] for i in range(per_step)]
            started = time.perf_counter()
            loss, tokens, grad_norm, skipped = train_step(
                model,
                optimizer,
                scheduler,
                batch,
                topology,
                dp_group,
                world_group,
                cfg.train.max_grad_norm,
                device,
                sharded=cfg.parallel.fsdp,
                whole_rows=cfg.vision_language,
            )
            seconds = time.perf_counter() - started
            losses.append(loss)
            row_tokens = len(batch) * cfg.data.seq_len * dp  # tokens processed this step, padding included
            stats = StepStats(
                step + 1,
                loss,
                tokens,
                grad_norm,
                scheduler.get_last_lr()[0],
                seconds,
                skipped,
                {"memory_gib": _memory_gib(device), "tokens_per_s": row_tokens / seconds},
            )
            if rank == 0:
                metrics.write(stats)
                progress.update(stats)
            nonfinite = nonfinite + 1 if skipped else 0  # skipped is the same on every rank (all-reduced)
            if nonfinite >= cfg.train.max_nonfinite_steps:
                _stop(
                    rank,
                    f"the loss or gradient norm was not finite for {nonfinite} consecutive steps (steps "
                    f"{step + 2 - nonfinite}-{step + 1}, train.max_nonfinite_steps={cfg.train.max_nonfinite_steps}); "
                    "lower train.lr, check the data, or resume from an earlier checkpoint",
                )
            if cfg.checkpoint.every and (step + 1) % cfg.checkpoint.every == 0 and step + 1 < steps:
                save_checkpoint(ckpt_dir, step + 1, model, optimizer, scheduler, run_state(step + 1))
        save_checkpoint(ckpt_dir, steps, model, optimizer, scheduler, run_state(steps))
        export_dir = None
        if cfg.checkpoint.export_hf:
            export_dir = out_dir / "hf"
            bad = nonfinite_parameters(model)
            if bad:
                _stop(
                    rank,
                    f"not exporting to {export_dir}: the weights hold inf or nan ({bad} tensor(s) on one rank; "
                    f"the checkpoint of step {steps} is saved); lower train.lr or train.max_nonfinite_steps",
                )
            export_model(cfg, model, export_dir)  # collective: gathers the full weights onto rank 0
            if rank == 0:
                tokenizer.save_pretrained(export_dir)
                if image_processor is not None:
                    image_processor.save_pretrained(export_dir)
            dist.barrier()
        if rank == 0:
            progress.close()
            print(f"[sft-train] checkpoints: {ckpt_dir}", flush=True)
            print(f"[sft-train] metrics: {metrics.path}", flush=True)
            run_summary = write_report_at_end(metrics.path, out_dir)
            if wandb_run is not None:  # beside the last step's values: the run's min loss, median tokens/s, ...
                wandb_run.summary.update({f"run/{key}": value for key, value in run_summary.items()})
            if export_dir:
                print(f"[sft-train] HF export: {export_dir}", flush=True)
        if wandb_run is not None:
            wandb_run.finish()
        return {"losses": losses, "checkpoint_dir": str(ckpt_dir)}
    finally:
        dist.destroy_process_group()


def nonfinite_parameters(model) -> int:
    """The most parameters (or FSDP shards of them) holding inf or nan on one rank; a collective, alike on all."""
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    count = torch.tensor([sum(int(not bool(torch.isfinite(t).all())) for t in local)], dtype=torch.int64)
    device = local[0].device if local else torch.device("cpu")
    count = count.to(device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return int(count.item())


def export_model(cfg, model, export_dir: Path) -> None:
    """HF checkpoint of the trained model, written by rank 0 (every rank must call: the full weights are gathered).

    With LoRA, the adapters are merged into the base weights (``checkpoint.merge_lora``), or the base checkpoint
    is written plus ``lora_adapters.safetensors`` (adapter tensors by module name).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from sft_trainer.lora import split_lora_state

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() != 0:
        return
    adapters = {}
    if cfg.train.lora.enabled:
        lora = cfg.train.lora
        state, adapters = split_lora_state(state, lora.alpha / lora.rank, merge=cfg.checkpoint.merge_lora)
    model.save_pretrained(export_dir, state_dict=state)
    if adapters and not cfg.checkpoint.merge_lora:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in adapters.items()}, str(Path(export_dir) / "lora_adapters.safetensors"))


def set_aside_previous_run(cfg) -> list[tuple[Path, Path]]:
    """A fresh run whose folders hold an earlier run's checkpoints, metrics or HF export moves them aside, to
    ``checkpoints.1``, ``metrics.1.jsonl``, ``hf.1`` (the first free number), so that nothing is lost and the runs
    never mix (an old ``step-000040`` beside the new run's ``latest``). Returns the moves made."""
    output_dir = Path(cfg.output_dir).resolve()
    read = [Path(p).resolve() for p in (cfg.model.path, cfg.data_path, cfg.tokenizer_path, cfg.data.processor) if p]
    candidates = [Path(p).resolve() for p in (cfg.checkpoint_dir, cfg.metrics_path, Path(cfg.output_dir) / "hf")]
    found = [
        p
        for p in dict.fromkeys(candidates)
        if ((p.is_dir() and any(p.iterdir())) or (p.is_file() and p.stat().st_size))
        and not output_dir.is_relative_to(p)  # never the run folder itself or a folder above it
        and not any(r.is_relative_to(p) for r in read)  # nor what this run reads (a model exported by the last one)
    ]
    found = [p for p in found if not any(p != q and p.is_relative_to(q) for q in found)]  # the outermost only
    if not found:
        return []

    def aside(path: Path, n: int) -> Path:
        return path.with_name(f"{path.stem}.{n}{path.suffix}")

    n = 1
    while any(aside(p, n).exists() for p in found):
        n += 1
    moves = [(p, aside(p, n)) for p in found]
    for old, new in moves:
        old.rename(new)
    listed = ", ".join(f"{old} -> {new.name}" for old, new in moves)
    print(
        f"[sft-train] an earlier run's outputs were here; moved aside: {listed} (checkpoint.resume = true continues "
        "a run instead)",
        flush=True,
    )
    return moves


def start_wandb(cfg):
    if not cfg.logging.wandb.enabled:
        return None
    try:
        import wandb
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise SystemExit("logging.wandb.enabled is true but wandb is not installed: pip install wandb") from exc
    return wandb.init(
        project=cfg.logging.wandb.project,
        name=cfg.logging.wandb.run_name,
        mode=cfg.logging.wandb.mode,
        dir=str(cfg.output_dir),
        config=cfg.model_dump(mode="json"),
    )


RUN_USAGE = (
    "Trains: spawns dp x cp local workers (CPU), or runs as one torchrun worker. `sft-train plan ...` takes the same\n"
    "config and prints the CP traffic, memory per rank and the longest row that fits instead (`sft-train plan --help`).\n"
    "`sft-train report RUN_DIR` plots a run's metrics.jsonl to RUN_DIR/report.png and prints a summary.\n"
    "`sft-train inspect-data ... [--rows N]` prints the first packed rows with the loss tokens marked, trains nothing."
)


def main(argv: list[str] | None = None) -> None:
    """Run :func:`start`; under torchrun a problem found before training is said by rank 0 alone (every rank
    finds it), the others exit with the same code."""
    try:
        start(argv)
    except SystemExit as exc:
        if os.environ.get("RANK", "0") != "0" and isinstance(exc.code, str):
            raise SystemExit(1) from None
        raise


def start(argv: list[str] | None = None) -> None:
    """``sft-train [--config FILE.toml] [--section.key VALUE ...]``: validate the config, then train.

    ``sft-train plan [--config FILE.toml] [--section.key VALUE ...] [--json]`` prints the run's CP traffic, memory
    per rank and the longest row that fits instead (``sft_trainer.plan``), starting nothing.
    ``sft-train report RUN_DIR`` plots a finished (or running) run's metrics and prints its summary
    (``sft_trainer.report``).
    ``sft-train inspect-data [--config ...] [--rows N]`` prints the first packed rows with their loss tokens marked
    and the packing statistics (``sft_trainer.inspect_data``), starting no worker.
    ``--config`` may stand anywhere among the overrides; the overrides apply on top of it, in order."""
    from sft_trainer.config import ConfigError, load_config, wants_help
    from sft_trainer.plan import split_config_argument

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "plan":
        from sft_trainer.plan import main as plan_main

        plan_main(argv[1:])
        return
    if argv and argv[0] == "inspect-data":
        from sft_trainer.inspect_data import main as inspect_main

        inspect_main(argv[1:])
        return
    if argv and argv[0] == "report":
        from sft_trainer.report import main as report_main

        report_main(argv[1:])
        return
    if wants_help(argv):
        from sft_trainer.config import config_help

        print(config_help("sft-train", RUN_USAGE, argv))
        return
    try:
        path, argv = split_config_argument(argv)  # --config FILE (or --config=FILE), anywhere among the overrides
        cfg = load_config(path, argv)
        dp, cp = world_layout(cfg)  # the process layout must fit before anything starts
    except ConfigError as exc:
        raise SystemExit(f"sft-train: invalid configuration:\n{exc}") from None
    problems = check_resume(cfg, dp * cp)
    if problems:
        raise SystemExit("sft-train: cannot resume:\n" + "\n".join(f"  - {p}" for p in problems))
    problems = output_problems(cfg) + runtime_problems(cfg)
    if problems:
        raise SystemExit("\n".join(f"sft-train: {p}" for p in problems))
    if os.environ.get("RANK", "0") == "0":  # the launcher, or torchrun's rank 0: holds the folders until it ends
        hold_run_folders(cfg)
    if _backend(cfg) == "nccl" and os.environ.get("RANK", "0") == "0":  # a GPU run
        warn_when_plan_does_not_fit(cfg)
    launch(cfg)


def runtime_problems(cfg) -> list[str]:
    """What this machine lacks for ``cfg`` (a GPU for NCCL or a CUDA kernel, an optional package), one line each."""
    import importlib.util

    problems = []
    cuda = torch.cuda.is_available()
    if cfg.parallel.backend == "nccl" and not cuda:
        problems.append("parallel.backend='nccl' needs CUDA GPUs and none is visible; use 'gloo' or 'auto' on CPU")
    for field, value, package in (
        ("model.attention_backend", cfg.model.attention_backend, "flash_attn"),
        ("model.recurrent_backend", cfg.model.recurrent_backend, "fla"),
    ):
        if value == package:
            if not cuda:
                problems.append(f"{field}={value!r} runs on CUDA GPUs only and none is visible; use 'auto' or 'torch'")
            elif importlib.util.find_spec(package) is None:
                problems.append(f"{field}={value!r} needs the {package} package, which is not installed; use 'auto'")
    if cfg.logging.wandb.enabled and importlib.util.find_spec("wandb") is None:
        problems.append(
            "logging.wandb.enabled=true but wandb is not installed: pip install sft-trainer[wandb], or set it false"
        )
    return problems


def _backend(cfg) -> str:
    """The process-group backend a run of ``cfg`` uses, without touching a device: "nccl" (on GPUs) or "gloo"."""
    backend = cfg.parallel.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    return backend


def warn_when_plan_does_not_fit(cfg, gpu_memory_gib: float | None = None) -> bool:
    """Before any weights load, print the planner's verdict when its per-rank estimate exceeds the GPU (the
    reason and the fixes ``sft-train plan`` gives). A warning, not a refusal: the estimate is within 15 % of the
    measured peaks, so a run near the limit may still fit. Returns whether the plan fits."""
    from sft_trainer.plan import build_plan

    try:
        plan = build_plan(cfg, gpu_memory_gib=gpu_memory_gib)
    except Exception as exc:  # the estimate is advice: a config the planner cannot read still trains
        print(f"[sft-train] note: no memory estimate ({type(exc).__name__}: {exc}); starting anyway", flush=True)
        return True
    for problem in plan["problems"]:
        print(f"[sft-train] warning: likely out of memory: {problem} (sft-train plan prints the estimate)", flush=True)
    return bool(plan["fits"])


if __name__ == "__main__":
    main()
