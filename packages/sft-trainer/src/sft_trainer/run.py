"""Start and run a training job: local workers or torchrun, device mesh, model, data, loop, checkpoints."""

from __future__ import annotations

import contextlib
import datetime
import os
import resource
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from cp_core import ContextParallelError, CPTopology
from cp_core.fla_tuning import TUNING_DIR_ENV, fla_version, tuning_folder, use_fla_tuning, write_fla_tuning
from sft_trainer.checkpoint import (
    CheckpointError,
    data_change_problem,
    maybe_resume,
    resume_checkpoint,
    resume_settings,
    save_checkpoint,
)
from sft_trainer.job_failure import announce_store, one_line, report_exception, say_once
from sft_trainer.model import ModelLoadError, build_model
from sft_trainer.progress import Progress
from sft_trainer.report import write_report_at_end
from sft_trainer.run_folder import set_aside_previous_run
from sft_trainer.train import MetricsWriter, StepStats, lr_lambda, train_step
from sft_trainer.watchdog import PeerWatch, collective_timeout, is_collective_timeout, run_workers, start_beating
from sft_trainer.worker_start import WorkerStart


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(cfg, workers: WorkerStart | None = None) -> None:
    """Run under torchrun when its variables are set; otherwise start dp x cp local workers (CPU runs), forked by
    ``workers``' fork server where it started one for a gloo run, else spawned."""
    if "RANK" in os.environ:
        run_worker_then_exit(cfg)
    dp, cp = cfg.parallel.world_layout()
    world = dp * cp
    workers = workers or WorkerStart()
    if backend_of(cfg) == "nccl":
        workers.stop()
    # a worker that stops prints its message or traceback; the launcher adds which worker and how it ended
    args = (cfg, world, _free_port())
    run_workers(_spawned, args, world, cfg.parallel.heartbeat_timeout_s, start_method=workers.method)


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
    # joinable, and the process can then die with SIGABRT ("terminate called without an active exception"),
    # after finishing or after a clean one-line stop, so the launcher would report a crash instead of the stop. The
    # exit code and the message (or traceback) are kept; the launcher reports the code.
    code = 0
    interrupted, failing = threading.Event(), threading.Event()

    def on_sigint(signum, frame) -> None:  # Ctrl-C, or the launcher forwarding it
        interrupted.set()
        if not failing.is_set():
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_sigint)
    peers = PeerWatch()
    try:
        if "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun: no launcher of ours watches, the ranks watch each other
            peers.start(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), cfg.parallel.heartbeat_timeout_s)
        worker(cfg)
    except SystemExit as exc:
        if isinstance(exc.code, int):
            code = exc.code
        elif exc.code is not None:  # SystemExit("message"): said once for the job, exit with 1
            say_once(str(exc.code))
            code = 1
    except KeyboardInterrupt:  # Ctrl-C reaches every worker: no traceback per process
        code = 130
    except BaseException as exc:
        failing.set()
        # A peer interrupted first can break this rank's collective before its own SIGINT is handled: wait a
        # moment for that signal, and leave as interrupted (quietly) when it comes.
        code = 130 if interrupted.wait(INTERRUPT_GRACE_S) else 1
        if code == 1 and is_collective_timeout(exc):
            rank = os.environ.get("RANK", "?")
            say_once(  # every surviving rank times out alike: the first says it
                f"sft-train: rank {rank}: a collective timed out after {cfg.parallel.collective_timeout_s:g} s "
                f"(parallel.collective_timeout_s): {peers.peers_that_stopped()}"
            )
        elif code == 1:
            report_exception(exc)
    peers.stop()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _device_and_backend(cfg) -> tuple[torch.device, str]:
    backend = backend_of(cfg)
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        use_fla_tuning(local)  # before anything imports fla: its kernels start from tuned configs, not autotuning
        return torch.device("cuda", local), backend
    return torch.device("cpu"), backend


def keep_fla_tuning(device: torch.device) -> None:
    """Write fla's autotune choices under ``$CP_FLA_TUNING_DIR`` (when set and fla is installed) after the first
    step, for the next process or node; a folder that cannot be written costs a warning, not the run."""
    root = os.environ.get(TUNING_DIR_ENV)
    if not root or fla_version() is None:  # never the package's shipped folder
        return
    folder = tuning_folder(root, device)
    try:
        count = write_fla_tuning(folder)
    except (OSError, ImportError, ContextParallelError) as exc:  # unwritable, or an fla without its config cache
        print(f"[sft-train] warning: {TUNING_DIR_ENV}: fla's kernel configs not written to {folder}: {exc}", flush=True)
    else:
        print(f"[sft-train] fla kernel configs: {count} choices written to {folder}", flush=True)


def _memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _stop(rank: int, message: str) -> NoReturn:
    """End this worker over a user-facing problem every rank meets alike: one clean line from rank 0, no traceback.
    Rank 0 says it first; every rank then waits for the others (at most STOP_WAIT_S) before it ends, since the
    launcher stops every worker as soon as one ends and rank 0 must have spoken by then."""
    if rank == 0:
        say_once(f"sft-train: {message}")
    _wait_for_every_rank(STOP_WAIT_S)
    raise SystemExit(1) from None


INTERRUPT_GRACE_S = 0.5  # how long a failing rank waits for a SIGINT that explains its failure
STOP_WAIT_S = 60.0  # a rank that never reaches the stop delays the others' exit by at most this


def _wait_for_every_rank(timeout_s: float) -> None:
    """A barrier over the world that gives up after ``timeout_s`` or when a peer is gone (then there is nobody to
    wait for)."""
    with contextlib.suppress(Exception):  # timed out, or a peer already ended: leave anyway
        dist.barrier(async_op=True).wait(timeout=datetime.timedelta(seconds=timeout_s))


def worker(cfg) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    from sft_trainer.data import ChatTemplateError, DataError, ReplicaRows, build_training_rows
    from sft_trainer.lora import dropout_seed
    from sft_trainer.tokenizer_fit import load_tokenizer

    device, backend = _device_and_backend(cfg)
    dp, cp = cfg.parallel.world_layout()
    # the mesh's subgroups take torch's default timeout, not the default group's: set that one too
    dist.distributed_c10d.default_pg_timeout = dist.distributed_c10d.default_pg_nccl_timeout = collective_timeout(cfg)
    dist.init_process_group(backend, timeout=collective_timeout(cfg))
    announce_store()  # sft-torchrun's launcher watches the job's store from here on
    try:
        rank = dist.get_rank()
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
            _stop(rank, f"{cfg.tokenizer_field} does not load: {one_line(exc)}")
        image_processor = None
        if cfg.vision_language and cfg.processor_path:
            from sft_trainer.data import load_image_processor

            image_processor = load_image_processor(cfg.processor_path)
        try:  # the data first: its mistakes show in seconds, before any weight loads
            rows, data_stats = build_training_rows(cfg, tokenizer, image_processor=image_processor)
        except DataError as exc:
            _stop(rank, f"data.path={str(cfg.data_path)!r}: {exc}")
        except ChatTemplateError as exc:
            _stop(rank, f"{cfg.tokenizer_field}: its chat template fails: {exc}")
        if data_stats.loss_tokens == 0:
            _stop(
                rank,
                f"data.path={str(cfg.data_path)!r}: no packed row holds a loss token ({data_stats}); nothing would be "
                "learned: raise data.seq_len or check that the conversations have assistant replies",
            )
        data_change = data_change_problem(cfg, rows.fingerprint)  # the launcher checks it first where it can
        if data_change:
            _stop(rank, data_change)
        try:
            model = build_model(cfg, tokenizer, mesh)
        except ModelLoadError as exc:
            _stop(rank, str(exc))
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
        try:  # equal rows per replica, reshuffled each epoch; rows are read when a step asks
            my_rows = ReplicaRows(rows, mesh.get_local_rank("dp"), dp)
        except DataError as exc:
            _stop(rank, f"data.path={str(cfg.data_path)!r}: {exc}")
        out_dir = Path(cfg.output_dir)
        ckpt_dir = cfg.checkpoint_dir
        try:
            start_step = maybe_resume(cfg, model, optimizer, scheduler)
        except CheckpointError as exc:  # not always every rank alike (one rank's altered file): the first says it
            say_once(f"sft-train: {exc}")
            raise SystemExit(1) from None
        metrics = MetricsWriter(cfg.metrics_path if rank == 0 else None, fresh=start_step == 0, resumed_at=start_step)
        wandb_run = start_wandb(cfg) if rank == 0 else None
        metrics.wandb_run = wandb_run
        if rank == 0:
            print(
                f"[sft-train] dp={dp} cp={cp} backend={backend} device={device.type}; "
                f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters; data: {data_stats}; packing "
                f"efficiency {rows.efficiency:.2%} (document tokens / row tokens)"
                + (
                    f"; fla kernel configs from {os.environ['FLA_CONFIG_DIR']}"
                    if "FLA_CONFIG_DIR" in os.environ
                    else ""
                ),
                flush=True,
            )
        losses = []
        per_step = cfg.train.grad_accum

        def run_state(done: int) -> dict[str, Any]:  # what a resume must match, and where this rank's data stands
            return {
                "train_steps": steps,
                "grad_accum": per_step,
                "data_position": done * per_step,
                "data_fingerprint": rows.fingerprint,
                "world_size": dp * cp,
                **resume_settings(cfg, dp, cp),
            }

        nonfinite = 0  # consecutive skipped steps
        if rank == 0:
            progress = Progress(steps, start_step, cfg.logging.log_every, cfg.logging.progress_bar)
        for step in range(start_step, steps):
            batch = [my_rows[step * per_step + i] for i in range(per_step)]  # data position: resumes exactly
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
                if step == start_step and device.type == "cuda":
                    keep_fla_tuning(device)
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
    adapters_file = Path(export_dir) / "lora_adapters.safetensors"
    if adapters and not cfg.checkpoint.merge_lora:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in adapters.items()}, str(adapters_file))
    elif adapters_file.is_file():  # an earlier export's adapters beside these weights would be applied twice
        adapters_file.unlink()


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


def backend_of(cfg) -> str:
    """The process-group backend a run of ``cfg`` uses, without touching a device: "nccl" (on GPUs) or "gloo"."""
    backend = cfg.parallel.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    return backend


if __name__ == "__main__":  # `python -m sft_trainer.run`, torchrun's form of `sft-train`
    from sft_trainer.cli import main

    main()
