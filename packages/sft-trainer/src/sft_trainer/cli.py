"""The ``sft-train`` command: subcommands, their argument splitting and ``--help``.

``sft-train [--config FILE.toml] [--section.key VALUE ...]`` validates the config, then trains
(:mod:`sft_trainer.run`). ``sft-train plan ...`` prints the run's CP traffic, memory per rank and the longest row
that fits instead (:mod:`sft_trainer.plan`), starting nothing. ``sft-train inspect-data ... [--rows N]`` prints the
first packed rows with their loss tokens marked (:mod:`sft_trainer.inspect_data`). ``sft-train report RUN_DIR``
plots a run's metrics (:mod:`sft_trainer.report`). ``--config`` may stand anywhere among the overrides; the
overrides apply on top of it, in order. ``python -m sft_trainer.run`` (torchrun's form) is the same command;
``sft-torchrun`` (:mod:`sft_trainer.torchrun`) runs it under torchrun's agent, one command per host.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NoReturn, Union

# the config (pydantic, cp_models, torch) is imported where used: a process started by spawn from sft-train
# re-imports this module as its main, and a tokenizing worker needs none of it
if TYPE_CHECKING:
    from pydantic import BaseModel

    from sft_trainer.config import TrainConfig

RUN_USAGE = (
    "Trains: spawns dp x cp local workers (CPU), or runs as one torchrun worker. `sft-train plan ...` takes the same\n"
    "config and prints the CP traffic, memory per rank and the longest row that fits instead (`sft-train plan --help`).\n"
    "`sft-train report RUN_DIR` plots a run's metrics.jsonl to RUN_DIR/report.png and prints a summary.\n"
    "`sft-train inspect-data ... [--rows N]` prints the first packed rows with the loss tokens marked, trains nothing."
)
PLAN_USAGE = (
    "Prints the run's CP strategy per layer type, bytes per step, memory per rank and the longest row that fits,\n"
    "from the config alone (nothing is built), and exits nonzero naming the reason when the run cannot work.\n"
    "Options besides the config keys: --json (machine-readable), --nvlink-gbps X (default 450, the bandwidth the\n"
    "communication time assumes), --gpu-memory-gib Y (default: this machine's GPU, else an H200's 139.8)."
)
INSPECT_USAGE = (
    "sft-train inspect-data [--config FILE.toml] [--section.key VALUE ...] [--rows N] [--color auto|always|never]\n"
    "Prints the first N packed rows of the run's data (default 2) with the loss tokens marked, and the packing\n"
    "statistics; it tokenizes through the run's token cache (building it when missing) and trains nothing."
)


def main(argv: Sequence[str] | None = None) -> None:
    """``sft-train``. Under torchrun a problem found before training is said by rank 0 alone (every rank finds
    it; under sft-torchrun its launcher says it); the others wait until it is said, then exit with the same code
    (torchrun stops every worker once one ends)."""
    try:
        start(argv)
    except KeyboardInterrupt:  # Ctrl-C during the checks and imports, before any worker: no traceback
        print("sft-train: interrupted", file=sys.stderr, flush=True)
        raise SystemExit(130) from None
    except SystemExit as exc:
        if "RANK" in os.environ and isinstance(exc.code, str):
            from sft_trainer.job_failure import say_once, wait_until_said

            if os.environ["RANK"] == "0":
                say_once(exc.code)
            else:
                wait_until_said()
            raise SystemExit(1) from None
        raise


def _data_change(cfg) -> list[str]:
    """The resumed checkpoint's data fingerprint against this run's data, before any worker starts (the workers
    check it again when it cannot be computed here, e.g. an unreadable tokenizer, which they report)."""
    from sft_trainer.checkpoint import data_change_problem, resume_checkpoint
    from sft_trainer.data.sources import needs_datasets

    if resume_checkpoint(cfg) is None or needs_datasets(str(cfg.data_path)):  # a hub set is fetched by the workers
        return []
    try:
        from sft_trainer.data import load_image_processor, store_options
        from sft_trainer.data.lookup import locate_store
        from sft_trainer.tokenizer_fit import load_tokenizer

        processor = load_image_processor(cfg.processor_path) if cfg.vision_language and cfg.processor_path else None
        fingerprint = locate_store(
            cfg.data_path,
            load_tokenizer(cfg.tokenizer_path),
            cfg.data.seq_len,
            image_processor=processor,
            **store_options(cfg.data),
        ).fingerprint
    except Exception:  # whatever fails here fails again in the workers, which say it in one line
        return []
    problem = data_change_problem(cfg, fingerprint)
    return [problem] if problem else []


def start(argv: Sequence[str] | None = None) -> None:
    """Dispatch ``argv`` (default: the process's arguments) to its subcommand, else train."""
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"plan": plan_main, "inspect-data": inspect_data_main, "report": report_main}
    if argv and argv[0] in commands:
        commands[argv[0]](argv[1:])
        return
    if wants_help(argv):
        print(config_help("sft-train", RUN_USAGE, argv))
        return
    if argv and not argv[0].startswith("-"):  # a bare first word can only be a subcommand: most often a typo of one
        if argv[0].endswith(".toml") or Path(argv[0]).is_file():
            raise SystemExit(f"sft-train: {argv[0]!r} is not a subcommand; a config file is given as --config FILE")
        raise SystemExit(
            f"sft-train: {argv[0]!r} is not a subcommand ({', '.join(commands)}), "
            "and overrides look like --section.key VALUE or --key=VALUE"
        )
    train_main(argv)


def train_main(argv: Sequence[str]) -> None:
    """``sft-train [--config FILE] [--section.key VALUE ...]``: validate the config and what this machine and the
    run folder allow, then train."""
    from sft_trainer.worker_start import WorkerStart

    workers = WorkerStart()
    workers.import_ahead()  # the workers' imports run while the config is checked (before torch is here)
    try:
        from sft_trainer import run
        from sft_trainer.run_folder import hold_run_folders

        cfg = checked_config(argv)
        if os.environ.get("RANK", "0") == "0":  # the launcher, or torchrun's rank 0: holds the folders until it ends
            hold_run_folders(cfg)
        if run.backend_of(cfg) == "nccl" and os.environ.get("RANK", "0") == "0":  # a GPU run
            warn_when_plan_does_not_fit(cfg)
    except BaseException:  # refused: no worker starts
        workers.stop()
        raise
    run.launch(cfg, workers)


def checked_config(argv: Sequence[str]) -> TrainConfig:
    """The run's config, once it, the checkpoint to resume, the output folders and this machine allow it to run;
    else SystemExit with one line per problem."""
    from sft_trainer.checkpoint import check_resume
    from sft_trainer.config import ConfigError, load_config
    from sft_trainer.run_folder import output_problems

    try:
        path, overrides = split_config_argument(argv)
        cfg = load_config(path, overrides)
        dp, cp = cfg.parallel.world_layout()  # the process layout must fit before anything starts
    except ConfigError as exc:
        raise SystemExit(f"sft-train: {exc}") from None
    problems = check_resume(cfg, dp * cp) or _data_change(cfg)
    if len(problems) == 1:
        raise SystemExit(f"sft-train: cannot resume: {problems[0]}")
    if problems:
        raise SystemExit("sft-train: cannot resume:\n" + "\n".join(f"  - {p}" for p in problems))
    problems = output_problems(cfg) + runtime_problems(cfg)
    if problems:
        raise SystemExit("\n".join(f"sft-train: {p}" for p in problems))
    return cfg


def runtime_problems(cfg: TrainConfig) -> list[str]:
    """What this machine lacks for ``cfg`` (a GPU for NCCL or a CUDA kernel, an optional package), one line each."""
    import torch

    problems = []
    cuda = torch.cuda.is_available()
    if cfg.parallel.backend == "nccl" and not cuda:
        problems.append("parallel.backend='nccl' needs CUDA GPUs and none is visible; use 'gloo' or 'auto' on CPU")
    for field, value, kernel, packages in (
        ("model.attention_backend", cfg.model.attention_backend, "flash_attn", ("flash_attn",)),
        ("model.recurrent_backend", cfg.model.recurrent_backend, "fla", ("fla",)),
        ("model.recurrent_backend", cfg.model.recurrent_backend, "mamba_ssm", ("mamba_ssm", "causal_conv1d")),
    ):
        if value == kernel:
            missing = [p for p in packages if importlib.util.find_spec(p) is None]
            if not cuda:
                problems.append(f"{field}={value!r} runs on CUDA GPUs only and none is visible; use 'auto' or 'torch'")
            elif missing:
                problems.append(
                    f"{field}={value!r} needs the {' and '.join(missing)} package(s), which are not installed; use 'auto'"
                )
    if cuda and (problem := _fla_backward_problem(cfg)):
        problems.append(problem)
    if cfg.logging.wandb.enabled and importlib.util.find_spec("wandb") is None:
        problems.append(
            "logging.wandb.enabled=true but wandb is not installed: pip install sft-trainer[wandb], or set it false"
        )
    return problems


def _fla_backward_problem(cfg: TrainConfig) -> str | None:
    """fla's gated backward refused on this GPU and Triton (cp_core.fla_backward_problem), for a run whose recurrent
    layers train through it on GPUs: Qwen3.5's GDN under every backend but "torch", Nemotron-H's SSD under "auto"
    and "fla" (under "mamba_ssm" its SSD and conv are mamba-ssm's). A gloo run trains on the CPU, without fla."""
    import torch

    from cp_core import fla_backward_problem
    from sft_trainer.config import ConfigError
    from sft_trainer.config.models import model_family, resolve_model_config
    from sft_trainer.run import backend_of

    backend = cfg.model.recurrent_backend
    if backend == "torch" or backend_of(cfg) != "nccl":
        return None
    try:
        family = model_family(resolve_model_config(cfg.model))
    except ConfigError:  # the model's config is unreadable: the workers say so
        return None
    if family == "nemotron_h" and backend == "mamba_ssm":
        return None
    device = int(os.environ.get("LOCAL_RANK", "0")) % max(1, torch.cuda.device_count())
    problem = fla_backward_problem(device, ssd=family == "nemotron_h")
    if problem is None:
        return None
    return f"model.recurrent_backend={backend!r} trains through fla's kernels: {problem}, or set it to 'torch' (slow)"


def warn_when_plan_does_not_fit(cfg: TrainConfig, gpu_memory_gib: float | None = None) -> bool:
    """Before any weights load, print the planner's verdict when its per-rank estimate exceeds the GPU (the
    reason and the fixes ``sft-train plan`` gives). A warning, not a refusal: the estimate is within 15 % of the
    measured peaks, so a run near the limit may still fit. Returns whether the plan fits."""
    from sft_trainer import plan

    try:
        built = plan.build_plan(cfg, gpu_memory_gib=gpu_memory_gib)
    except Exception as exc:  # the estimate is advice: a config the planner cannot read still trains
        print(f"[sft-train] note: no memory estimate ({type(exc).__name__}: {exc}); starting anyway", flush=True)
        return True
    for problem in built["problems"]:
        print(f"[sft-train] warning: likely out of memory: {problem} (sft-train plan prints the estimate)", flush=True)
    return bool(built["fits"])


# ----------------------------------------------------------------------------------------------------------
# sft-train plan

_PLAN_OPTIONS = {"--nvlink-gbps": float, "--gpu-memory-gib": float}


def plan_main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """``sft-train plan [--config FILE] [--section.key VALUE ...] [--json] [--nvlink-gbps X] [--gpu-memory-gib Y]``.

    Validates the config as training would, prints the plan (a table, or JSON with ``--json``) and exits nonzero
    naming the reason when the config is invalid or does not fit the GPU. Returns the plan dict."""
    from sft_trainer.config import ConfigError, load_config
    from sft_trainer.plan import NVLINK_GBPS, build_plan, format_plan

    argv = list(sys.argv[1:] if argv is None else argv)
    if wants_help(argv):
        print(config_help("sft-train plan", PLAN_USAGE, argv))
        return {}
    options, rest = _split_plan_options(argv)
    try:
        path, overrides = split_config_argument(rest)
        cfg = load_config(path, overrides, fetch_weights=False)  # a hub model: config and tokenizer suffice
        plan = build_plan(
            cfg, gpu_memory_gib=options.get("gpu_memory_gib"), nvlink_gbps=options.get("nvlink_gbps", NVLINK_GBPS)
        )
    except ConfigError as exc:
        raise SystemExit(f"sft-train plan: {exc}") from None
    if options["json"]:
        print(json.dumps(plan, indent=1, default=_json_default))
    else:
        print(format_plan(plan))
    if plan["problems"]:
        raise SystemExit("sft-train plan: " + "\n".join(plan["problems"]))
    return plan


def _split_plan_options(argv: Sequence[str]) -> tuple[dict[str, Any], list[str]]:
    options: dict[str, Any] = {"json": False}
    rest: list[str] = []
    tokens = list(argv)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        name, _, inline = token.partition("=")
        if token == "--json":
            options["json"] = True
        elif name in _PLAN_OPTIONS:
            raw = inline if inline else (tokens[i + 1] if i + 1 < len(tokens) else None)
            if not inline:
                i += 1
            try:
                value = _PLAN_OPTIONS[name](raw)
                if not (0 < value < math.inf):  # nan fails both comparisons
                    raise ValueError
            except (TypeError, ValueError):
                raise SystemExit(f"sft-train plan: {name} takes a positive finite number, got {raw!r}") from None
            options[name[2:].replace("-", "_")] = value
        else:
            rest.append(token)
        i += 1
    return options, rest


def _json_default(value: Any) -> Any:
    if hasattr(value, "__dataclass_fields__"):
        return asdict(value)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    raise TypeError(f"cannot serialize {type(value).__name__}")


# ----------------------------------------------------------------------------------------------------------
# sft-train inspect-data, sft-train report


class _OneLineParser(argparse.ArgumentParser):
    """argparse whose usage error is one line naming the argument and where the options are listed, not the
    usage and description printed above it (exit status 2, as argparse's)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} ({self.prog} --help lists its arguments)\n")


class _StoreOnce(argparse.Action):
    """An option that may be given once: a second value would silently replace the first."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        given = namespace.__dict__.setdefault("_given_once", {})
        if self.dest in given:
            parser.error(f"argument {option_string}: given twice ({given[self.dest]!r} and {values!r}); give it once")
        given[self.dest] = values
        setattr(namespace, self.dest, values)


def inspect_data_main(argv: Sequence[str]) -> None:
    """``sft-train inspect-data``: see :data:`INSPECT_USAGE`."""
    parser = _OneLineParser(prog="sft-train inspect-data", usage=INSPECT_USAGE, add_help=True)
    parser.add_argument("--rows", type=int, default=2, action=_StoreOnce)
    parser.add_argument("--color", choices=("auto", "always", "never"), default="auto", action=_StoreOnce)
    options, overrides = parser.parse_known_args(list(argv))
    if options.rows < 0:
        raise SystemExit(f"sft-train inspect-data: --rows={options.rows} must be >= 0")
    # imported once the options are read: a mistyped option is said at once, not after seconds of imports
    from sft_trainer.config import ConfigError, load_config
    from sft_trainer.data import ChatTemplateError, DataError
    from sft_trainer.inspect_data import inspect

    color = options.color == "always" or (options.color == "auto" and sys.stdout.isatty())
    try:
        path, overrides = split_config_argument(overrides)
        cfg = load_config(path, overrides, fetch_weights=False)
    except ConfigError as exc:
        raise SystemExit(f"sft-train inspect-data: {exc}") from None
    try:
        inspect(cfg, options.rows, color)
    except DataError as exc:
        raise SystemExit(f"sft-train inspect-data: data.path={str(cfg.data_path)!r}: {exc}") from None
    except ChatTemplateError as exc:
        raise SystemExit(f"sft-train inspect-data: {cfg.tokenizer_field}: its chat template fails: {exc}") from None


def report_main(argv: Sequence[str] | None = None) -> None:
    """``sft-train report RUN_DIR``: the run's summary, and RUN_DIR/report.png."""
    from sft_trainer.report import ReportError, report

    parser = _OneLineParser(
        prog="sft-train report",
        description="Plot a run's metrics.jsonl (loss, lr, grad norm, tokens/s, memory vs step) to "
        "RUN_DIR/report.png and print a summary. The PNG needs matplotlib: pip install 'sft-trainer[report]'.",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", type=Path, help="the run's output_dir (holds metrics.jsonl)")
    args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    try:
        summary, png = report(args.run_dir)
    except ReportError as exc:
        raise SystemExit(f"sft-train report: {exc}") from None
    print(summary)
    if png is None:
        raise SystemExit(
            "sft-train report: no report.png: matplotlib is not installed (pip install 'sft-trainer[report]')"
        )
    print(f"report: {png}")


# ----------------------------------------------------------------------------------------------------------
# Arguments and help


def split_config_argument(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    """``--config FILE`` (or ``--config=FILE``), anywhere among the overrides -> (FILE or None, the overrides)."""
    from sft_trainer.config import ConfigError

    path, rest, argv = None, [], list(argv)
    i = 0
    while i < len(argv):
        token, found = argv[i], None
        if token == "--config":
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                raise ConfigError("--config needs a value: --config FILE.toml (or a shipped config's name)")
            found, i = argv[i + 1], i + 2
        elif token.startswith("--config="):
            found, i = token.split("=", 1)[1], i + 1
        else:
            rest.append(token)
            i += 1
        if found is not None:
            if path is not None:
                raise ConfigError(f"--config given twice ({path!r} and {found!r}); give one file, then overrides")
            path = found
    return path, rest


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return "|".join(json.dumps(a) if isinstance(a, str) else str(a) for a in typing.get_args(annotation))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation)).replace("typing.", "")


def wants_help(argv: Sequence[str]) -> bool:
    """Whether a command line asks for help: ``help`` first, or ``-h`` / ``--help`` anywhere."""
    return list(argv[:1]) == ["help"] or any(a in ("-h", "--help") for a in argv)


def config_help(command: str, about: str = "", argv: Sequence[str] = ()) -> str:
    """The usage of ``command`` and every config key: its dotted name, type, the value a run with the rest of the
    command line ``argv`` gets (its --config and overrides; unknown options are ignored here), and its description."""

    from sft_trainer.config import CONFIGS_DIR, ConfigError, TrainConfig, starting_data
    from sft_trainer.config.overrides import _submodel

    shipped = ", ".join(sorted(p.stem for p in CONFIGS_DIR.glob("*.toml")))
    try:
        path, overrides = split_config_argument([a for a in argv if a not in ("help", "-h", "--help")])
        data, source, _ = starting_data(path, overrides)
    except ConfigError:
        data, source = {}, "schema defaults (the config file could not be read)"
    lines = [
        f"usage: {command} [--config FILE.toml] [--section.key VALUE ...]",
        "",
        *([about, ""] if about else []),
        f"--config names a TOML file or a shipped config ({shipped}). Without it, a command line naming a",
        "checkpoint (--model.path) starts from the schema defaults, any other from tiny_cpu. Every key below can be",
        "set there or overridden here, as --section.key VALUE or --section.key=VALUE (TOML values: 3, 1e-4, true,",
        "'text', [1, 2]); true/false keys may stand alone (--train.lora.enabled). The values shown are the ones",
        f"this command line gets ({source}). Docs: docs/sft-trainer.md.",
    ]

    def walk(cls: type[BaseModel], prefix: str, given: Mapping[str, Any]) -> None:
        fields = cls.model_fields.items()
        for name, field in fields:  # a section's own keys first, then its subsections, so none sits under another
            if _submodel(field.annotation) is None:
                value = given[name] if name in given else field.get_default(call_default_factory=True)
                shown = json.dumps(list(value) if isinstance(value, tuple) else value, default=str)
                lines.append(f"  --{prefix}{name} ({_type_name(field.annotation)}, value {shown})")
                if field.description:
                    lines.append(f"      {field.description}")
        for name, field in fields:
            sub = _submodel(field.annotation)
            if sub is not None:
                lines.extend(["", f"[{prefix}{name}] {field.description or ''}".rstrip()])
                section = given.get(name)
                walk(sub, f"{prefix}{name}.", section if isinstance(section, Mapping) else {})

    walk(TrainConfig, "", data)
    return "\n".join(lines)
