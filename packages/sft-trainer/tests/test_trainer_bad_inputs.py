"""Bad inputs end with one clear line, never a traceback or a hang: those knowable from the config and the machine
before any worker starts (in-process, through ``main``), and those met by the workers (subprocesses, cp = 1):
weights that do not load, a chat template that fails, data without a loss token. Under torchrun a problem is
said once, by rank 0."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import time

import pytest
import torch
from trainer_runs import one_line_failure, sft_train, worker_in_process

from sft_trainer.cli import main
from sft_trainer.config import SHIPPED_MODEL_CONFIGS, SHIPPED_TOKENIZER

# (case id, overrides, fragment of the message); every case must stop in main, before a worker starts
PRE_LAUNCH = [
    ("empty_output_dir", ["--output_dir", ""], "output_dir='': must not be empty: give a value, or leave the key"),
    ("blank_output_dir", ["--output_dir", "  "], "sft-train: output_dir='  ': must name a folder"),
    ("empty_resume", ["--checkpoint.resume", ""], "checkpoint.resume='': must not be empty: true (the latest"),
    ("multi_line_value", ["--train.steps", "5\nlr = 1"], "--train.steps='5\\nlr = 1': a value must be one line"),
    ("config_is_a_folder", ["--config", "{tmp}"], "is a folder; --config names a TOML file"),
    ("seed_2_63", ["--train.seed", str(2**63)], "train.seed=9223372036854775808: Input should be less than"),
    ("huge_seq_len", ["--data.seq_len", str(10**9)], "data.seq_len=1000000000: Input should be less than or equal"),
    ("lr_inf", ["--train.lr", "inf"], "train.lr=inf: must be a finite number"),
    ("grad_norm_nan", ["--train.max_grad_norm", "nan"], "train.max_grad_norm=nan: must be a finite number"),
    ("micro_batch_4", ["--train.micro_batch_size", "4", "--parallel.cp", "1"], "train.micro_batch_size=4 must be 1"),
    ("nccl_on_cpu", ["--parallel.backend", "nccl"], "parallel.backend='nccl' needs CUDA GPUs and none is visible"),
    ("flash_attn_on_cpu", ["--model.attention_backend", "flash_attn"], "model.attention_backend='flash_attn' runs on"),
    ("fla_on_cpu", ["--model.recurrent_backend", "fla"], "model.recurrent_backend='fla' runs on CUDA GPUs only"),
    (
        "mamba_ssm_on_cpu",
        ["--model.recurrent_backend", "mamba_ssm"],
        "model.recurrent_backend='mamba_ssm' runs on CUDA GPUs only",
    ),
    ("wandb_missing", ["--logging.wandb.enabled", "true"], "logging.wandb.enabled=true but wandb is not installed"),
    ("metrics_file_is_a_folder", ["--logging.metrics_file", "{tmp}"], "is a folder; name a file"),
    ("output_dir_is_a_file", ["--output_dir", "{tmp}/file"], "is a file, not a folder"),
    (
        "tokenizer_json_corrupt",
        ["--data.tokenizer", "{tmp}/tok_corrupt"],
        "/tok_corrupt' does not load: tokenizer.json is not valid JSON (Expecting",
    ),
    (
        "template_syntax_error",
        ["--data.tokenizer", "{tmp}/tok_syntax"],
        "/tok_syntax' has a chat template that does not compile (line 1): TemplateSyntaxError: unexpected '}'",
    ),
    ("no_chat_template", ["--data.tokenizer", "{tmp}/tok_none"], "/tok_none' has no chat template"),
    (
        "chat_template_not_utf8",
        ["--data.tokenizer", "{tmp}/tok_latin1"],
        "/tok_latin1' does not load: chat_template.jinja is not UTF-8 text (invalid continuation byte at byte 6)",
    ),
    ("garbage_parquet", ["--data.path", "{tmp}/garbage.parquet"], "garbage.parquet': cannot read as Parquet ("),
    (
        "parquet_without_conversations",
        ["--data.path", "{tmp}/text.parquet"],
        "text.parquet': no 'messages' column (columns: ['text'])",
    ),
    (
        "folder_without_data_files",
        ["--data.path", "{tmp}/tok_none"],
        "tok_none': directory holds no .jsonl or .parquet",
    ),
]


def _tokenizer_with_template(folder, template: str | None):
    shutil.copytree(SHIPPED_TOKENIZER, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    if template is None:
        del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def _bad_tokenizers(tmp_path) -> None:
    """The tokenizer folders PRE_LAUNCH names: tokenizer.json cut short, a template that does not compile, none."""
    corrupt = shutil.copytree(SHIPPED_TOKENIZER, tmp_path / "tok_corrupt")
    (corrupt / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": \n[1, 2')
    _tokenizer_with_template(tmp_path / "tok_syntax", "{% for m in messages %}{{ m }")
    _tokenizer_with_template(tmp_path / "tok_none", None)
    latin1 = _tokenizer_with_template(tmp_path / "tok_latin1", None)
    (latin1 / "chat_template.jinja").write_bytes("{# café #}".encode("latin-1"))


def _bad_data_files(tmp_path) -> None:
    """The data files PRE_LAUNCH names: bytes that are not Parquet, a Parquet file without a conversation column."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "garbage.parquet").write_bytes(b"PAR1" + bytes(range(256)) * 4)
    pq.write_table(pa.table({"text": ["hello"]}), tmp_path / "text.parquet")


@pytest.mark.parametrize(("overrides", "fragment"), [c[1:] for c in PRE_LAUNCH], ids=[c[0] for c in PRE_LAUNCH])
def test_pre_launch_mistakes_stop_in_main_with_one_clear_line(tmp_path, monkeypatch, overrides, fragment):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU machine these cases describe
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real_find_spec(name))
    (tmp_path / "file").write_text("x")
    _bad_tokenizers(tmp_path)
    _bad_data_files(tmp_path)
    argv = [a.replace("{tmp}", str(tmp_path)) for a in overrides]
    if "--output_dir" not in argv:
        argv = ["--output_dir", str(tmp_path / "out"), *argv]
    started = time.monotonic()
    with pytest.raises(SystemExit) as info:
        main(argv)
    seconds = time.monotonic() - started
    message = str(info.value.code)
    assert fragment in message, message
    lines = [line for line in message.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("sft-train: "), message
    assert not (tmp_path / "out").exists()  # nothing written, nothing started
    assert seconds < 10, seconds


def _tiny_checkpoint(folder):
    from transformers import AutoTokenizer

    from cp_models import Qwen35ForCausalLM
    from sft_trainer.config import tiny_qwen35_config

    tokenizer = AutoTokenizer.from_pretrained(SHIPPED_TOKENIZER)
    Qwen35ForCausalLM(tiny_qwen35_config(len(tokenizer))).save_pretrained(folder)
    tokenizer.save_pretrained(folder)  # a checkpoint folder holds its tokenizer, the default for model.path
    return folder


_CP1 = ("--parallel.cp", "1", "--data.seq_len", "64", "--train.steps", "2", "--train.warmup_steps", "0",
        "--logging.progress_bar", "false", "--checkpoint.export_hf", "false")  # fmt: skip


# case -> (a chat template, the start of the error it stops with): its raise_exception, a sandbox refusal, and
# errors in the template's own code
FAILING_TEMPLATES = {
    "template_raises": ("{{ raise_exception('no system role') }}", "TemplateError: no system role"),
    "template_escapes_the_sandbox": (
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "SecurityError: access to attribute",
    ),
    "template_code_fails": ("{{ messages[0]['content'] + 1 }}", "TypeError: can only concatenate str"),
    "template_divides_by_zero": ("{{ messages | length // 0 }}", "ZeroDivisionError"),
    "template_range_over_the_sandbox_limit": (
        "{% for i in range(10**9) %}{% endfor %}",
        "OverflowError: Range too big",
    ),
    "template_loops_for_hours": (  # 10^10 iterations within the sandbox's range limit; the limit set to 1 s here
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "rendering one conversation ran past 1 s",
    ),
}


# a refusal of the sandbox, or a template past the time limit, fails whatever the row
TEMPLATE_WIDE = ("template_escapes_the_sandbox", "template_range_over_the_sandbox_limit", "template_loops_for_hours")


def _worker_case(tmp_path, case: str) -> tuple[list[str], str]:
    if case == "truncated_safetensors":
        ckpt = _tiny_checkpoint(tmp_path / "ckpt")
        weights = ckpt / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
        return ["--model.path", str(ckpt)], f"sft-train: model.path={str(ckpt)!r} does not load: "
    if case in ("nan_weights", "integer_weights"):
        from cp_models.hf_checkpoint import read_safetensors, write_safetensors

        ckpt = _tiny_checkpoint(tmp_path / "ckpt")
        state = read_safetensors(ckpt)
        norm = "model.norm.weight"
        state[norm] = torch.full_like(state[norm], float("nan")) if case == "nan_weights" else state[norm].int()
        (ckpt / "model.safetensors").unlink()
        write_safetensors(state, ckpt)
        reason = (
            "holds inf or nan in 1 tensor(s) (model.norm.weight)"
            if case == "nan_weights"
            else ("weights must be floating point; model.norm.weight (torch.int32) are not")
        )
        return ["--model.path", str(ckpt)], f"sft-train: model.path={str(ckpt)!r} " + (
            reason if case == "nan_weights" else f"does not load: ContextParallelError: {ckpt}: {reason}"
        )
    if case == "model_too_large_for_memory":  # sizes within the rules; the weights' 2^48 bytes are not
        config = tmp_path / "huge.json"
        text = {**json.loads((SHIPPED_MODEL_CONFIGS / "qwen3_5-0.8b.json").read_text())}
        text.update(hidden_size=2**23, vocab_size=2**23, num_hidden_layers=1, layer_types=["full_attention"])
        config.write_text(json.dumps(text))
        return ["--model.config", str(config)], f"sft-train: model.config={str(config)!r} does not build a model: "
    if case == "shapes_disagree_with_config":
        ckpt = _tiny_checkpoint(tmp_path / "ckpt")
        config = json.loads((ckpt / "config.json").read_text())
        config["intermediate_size"] = 96
        (ckpt / "config.json").write_text(json.dumps(config))
        return ["--model.path", str(ckpt)], f"sft-train: model.path={str(ckpt)!r} does not load: "
    if case in FAILING_TEMPLATES:
        template, error = FAILING_TEMPLATES[case]
        tok = _tokenizer_with_template(tmp_path / "tok", template)
        if case in TEMPLATE_WIDE:  # the template's own failure whatever the row: the job stops, naming the tokenizer
            return ["--data.tokenizer", str(tok)], f"data.tokenizer={str(tok)!r}: its chat template fails: {error}"
        # a template that fails on a row is that row's problem (its role checks, a type it does not take)
        return ["--data.tokenizer", str(tok)], f"row 1: the chat template fails on this conversation: {error}"
    if case == "resume_of_another_model":  # passes the launcher's checks (layout, steps); its tensors differ
        from test_trainer_outputs import fake_checkpoint

        ckpt = fake_checkpoint(tmp_path / "ckpt", step=1, ranks=1, train_steps=2, grad_accum=2)
        return [
            "--checkpoint.resume",
            str(ckpt),
        ], "does not load into this run (RuntimeError: Missing key in checkpoint state_dict: model."
    if case == "no_loss_token":
        return ["--data.seq_len", "8"], "no packed row holds a loss token"
    raise AssertionError(case)


WORKER_CASES = [
    "truncated_safetensors",
    "nan_weights",
    "integer_weights",
    "model_too_large_for_memory",
    "shapes_disagree_with_config",
    *FAILING_TEMPLATES,
    "no_loss_token",
    "resume_of_another_model",
]


@pytest.mark.parametrize("case", WORKER_CASES)
def test_worker_mistakes_stop_with_one_clear_line(tmp_path, monkeypatch, capfd, case):
    """Every case through the worker itself (in this process, one rank): exit code 1 and one line, no traceback.
    The cases in REAL_PROCESS_CASES run as real ``sft-train`` processes below."""
    overrides, fragment = _worker_case(tmp_path, case)
    from sft_trainer.data import render

    monkeypatch.setattr(render, "RENDER_LIMIT_S", 1.0)
    started = time.monotonic()
    code = worker_in_process(monkeypatch, ["--output_dir", str(tmp_path / "out"), *_CP1, *overrides])
    seconds = time.monotonic() - started
    stderr = capfd.readouterr().err
    line = one_line_failure(subprocess.CompletedProcess([], code, "", stderr))
    assert fragment in line, line
    assert not (tmp_path / "out" / "metrics.jsonl").exists() or case == "no_loss_token"
    print(f"{case} (in process): {seconds:.1f} s")


# One case of each kind the workers meet (weights, chat template) as a whole sft-train process: the launcher, its
# worker, the exit code and the single line the user sees.
REAL_PROCESS_CASES = ["truncated_safetensors", "template_raises"]


@pytest.mark.parametrize("case", REAL_PROCESS_CASES)
def test_worker_mistakes_end_the_process_with_one_clear_line(tmp_path, case):
    overrides, fragment = _worker_case(tmp_path, case)
    proc, seconds = sft_train("--output_dir", str(tmp_path / "out"), *_CP1, *overrides, timeout=240)
    line = one_line_failure(proc)
    assert fragment in line, line
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
    print(f"{case}: {seconds:.1f} s")


@pytest.mark.parametrize(
    ("template", "fragment"),
    [
        ("{{ messages[0]['content'] + 1 }}", ": row 1: the chat template fails on this conversation: TypeError: can"),
        ("{{ ''.__class__.__mro__[1].__subclasses__() }}", ": its chat template fails: SecurityError"),
    ],
    ids=["code_fails", "sandbox"],
)
def test_inspect_data_says_a_failing_template_in_one_line(tmp_path, monkeypatch, template, fragment):
    """A failure in the template's code is the row's (named by file and row); a sandbox refusal the template's
    (named by the tokenizer)."""
    monkeypatch.setenv("SFT_TRAINER_CACHE", str(tmp_path / "cache"))
    tok = _tokenizer_with_template(tmp_path / "tok", template)
    with pytest.raises(SystemExit) as info:
        main(["inspect-data", "--data.tokenizer", str(tok), "--data.seq_len", "64"])
    message = str(info.value.code)
    said = "data.path=" if "row 1" in fragment else f"data.tokenizer={str(tok)!r}"
    assert message.startswith(f"sft-train inspect-data: {said}")
    assert fragment in message and "\n" not in message


def test_inspect_data_refuses_a_template_that_does_not_compile_before_rendering(tmp_path, monkeypatch):
    monkeypatch.setenv("SFT_TRAINER_CACHE", str(tmp_path / "cache"))
    tok = _tokenizer_with_template(tmp_path / "tok", "{% for m in messages %}{{ m }")
    with pytest.raises(SystemExit) as info:
        main(["inspect-data", "--data.tokenizer", str(tok), "--data.seq_len", "64"])
    (line,) = str(info.value.code).splitlines()
    assert line.startswith("sft-train inspect-data: invalid config (")
    assert line.endswith(f"data.tokenizer={str(tok)!r} has a chat template that does not compile (line 1): "
                         "TemplateSyntaxError: unexpected '}'")  # fmt: skip
    assert not (tmp_path / "cache").exists()  # refused before any row was read


@pytest.mark.parametrize(
    ("template", "tag"),
    [
        ("{% include 'base.jinja' %}", "include"),
        ("{% import 'macros.jinja' as m %}{{ m.say(messages) }}", "import"),
        ("{% extends 'base.jinja' %}", "extends"),
    ],
)
def test_a_template_that_loads_another_is_refused_before_rendering(tmp_path, monkeypatch, template, tag):
    """apply_chat_template gives the template no loader: every row would fail, so it is said once, at launch."""
    monkeypatch.setenv("SFT_TRAINER_CACHE", str(tmp_path / "cache"))
    tok = _tokenizer_with_template(tmp_path / "tok", "{% for m in messages %}{{ m.content }}{% endfor %}\n" + template)
    with pytest.raises(SystemExit) as info:
        main(["inspect-data", "--data.tokenizer", str(tok), "--data.seq_len", "64"])
    (line,) = str(info.value.code).splitlines()
    assert line.endswith(f"data.tokenizer={str(tok)!r} has a chat template that loads another template "
                         f"({{% {tag} %}}, line 2), which apply_chat_template cannot: put the other template's text "
                         "in place")  # fmt: skip
    assert not (tmp_path / "cache").exists()


def test_under_torchrun_a_mistake_is_said_once(tmp_path):
    """Every torchrun rank finds the same config problem; rank 0 alone says it (torchrun then prints its own
    summary of the failed ranks)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "sft_trainer.run", "--output_dir", str(tmp_path / "out"), "--train.lr", "inf"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0
    assert proc.stderr.count("train.lr=inf: must be a finite number") == 1, proc.stderr[-3000:]


@pytest.mark.parametrize(
    ("overrides", "ssd", "refused"),
    [
        ([], False, True),  # "auto": every family's recurrent layers train through fla on CUDA
        (["--model.recurrent_backend", "fla"], False, True),
        (["--model.preset", "tiny-nemotron_h"], True, True),
        (["--model.recurrent_backend", "mamba_ssm"], False, True),  # Qwen3.5's GDN has no mamba-ssm kernel: fla's
        (["--model.recurrent_backend", "mamba_ssm", "--model.preset", "tiny-nemotron_h"], None, False),
        (["--model.recurrent_backend", "torch"], None, False),
        (["--parallel.backend", "gloo"], None, False),  # a CPU run on a GPU machine: no fla
    ],
    ids=["auto", "fla", "auto-nemotron_h", "mamba_ssm-qwen3_5", "mamba_ssm-nemotron_h", "torch", "gloo"],
)
def test_fla_backward_refused_on_this_gpu_stops_before_launch(tmp_path, monkeypatch, overrides, ssd, refused):
    """Where fla refuses its gated backward (a Hopper GPU with Triton >= 3.4 and < 3.7.1), a run that would train
    through it stops before any worker starts, naming the Triton to install."""
    import torch

    import cp_core
    from sft_trainer.cli import checked_config

    problem = "Triton 3.6.0 on NVIDIA H100 80GB HBM3 (Hopper): <fla's rule>; install triton>=3.7.1"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    asked = []
    monkeypatch.setattr(cp_core, "fla_backward_problem", lambda device, ssd: asked.append(ssd) or problem)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name in ("fla", "mamba_ssm", "causal_conv1d") else
        real_find_spec(name, *a)
    )  # fmt: skip
    argv = ["--output_dir", str(tmp_path / "out"), "--parallel.backend", "nccl", *overrides]
    if not refused:
        assert checked_config(argv).output_dir == str(tmp_path / "out")
        assert asked == []
        return
    backend = overrides[1] if "--model.recurrent_backend" in overrides else "auto"
    with pytest.raises(SystemExit) as info:
        checked_config(argv)
    assert str(info.value.code) == (
        f"sft-train: model.recurrent_backend={backend!r} trains through fla's kernels: {problem}, or set it to "
        "'torch' (slow)"
    )
    assert asked == [ssd]  # tilelang can take GDN's backward, not the SSD's


def test_mamba_ssm_backend_without_its_packages_names_them(tmp_path, monkeypatch):
    """On a GPU machine without causal-conv1d, recurrent_backend 'mamba_ssm' stops before launch naming it."""
    import torch

    from sft_trainer.cli import runtime_problems
    from sft_trainer.config import load_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "mamba_ssm" else
        (None if name == "causal_conv1d" else real_find_spec(name, *a))
    )  # fmt: skip
    cfg = load_config(None, ["--output_dir", str(tmp_path), "--model.recurrent_backend", "mamba_ssm"])
    problems = runtime_problems(cfg)
    assert problems == [
        "model.recurrent_backend='mamba_ssm' needs the causal_conv1d package(s), which are not installed; use 'auto'"
    ]


def test_ctrl_c_before_any_worker_ends_with_one_line(monkeypatch, capsys):
    """Ctrl-C while the launcher checks the config and imports (before any worker): exit 130, one line."""
    import sft_trainer.cli as cli

    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "start", interrupted)
    with pytest.raises(SystemExit) as info:
        cli.main(["--train.steps", "2"])
    assert info.value.code == 130
    assert capsys.readouterr().err == "sft-train: interrupted\n"


@pytest.mark.parametrize(
    "argv,said",
    [
        (["inspect-data", "--rows", "abc"], "sft-train inspect-data: argument --rows: invalid int value: 'abc'"),
        (
            ["inspect-data", "--color", "purple"],
            "sft-train inspect-data: argument --color: invalid choice: 'purple' (choose from 'auto', 'always', 'never')",
        ),
        (["inspect-data", "--rows"], "sft-train inspect-data: argument --rows: expected one argument"),
        (
            ["inspect-data", "--rows", "1", "--rows=2"],
            "sft-train inspect-data: argument --rows: given twice (1 and 2); give it once",
        ),
        (["report"], "sft-train report: the following arguments are required: RUN_DIR"),
        (["report", "a", "b"], "sft-train report: unrecognized arguments: b"),
    ],
)
def test_a_subcommand_argument_mistake_is_one_line_with_exit_2(capsys, argv, said):
    """argparse's own error would print the usage and the description above the line."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    command = " ".join(["sft-train", argv[0]])
    assert capsys.readouterr().err == f"{said} ({command} --help lists its arguments)\n"


def test_a_config_file_given_as_the_first_word_is_pointed_to_config():
    with pytest.raises(SystemExit) as info:
        main(["my.toml", "--train.steps", "2"])
    assert info.value.code == "sft-train: 'my.toml' is not a subcommand; a config file is given as --config FILE"


def test_a_mistyped_subcommand_names_the_subcommands():
    with pytest.raises(SystemExit) as info:
        main(["trian", "--train.steps", "2"])
    assert info.value.code == (
        "sft-train: 'trian' is not a subcommand (plan, inspect-data, report), "
        "and overrides look like --section.key VALUE or --key=VALUE"
    )


def test_one_resume_problem_is_one_line_and_several_a_list(tmp_path, monkeypatch):
    not_a_checkpoint = tmp_path / "other"
    not_a_checkpoint.mkdir()
    argv = ["--output_dir", str(tmp_path / "out"), "--checkpoint.resume", str(not_a_checkpoint)]
    with pytest.raises(SystemExit) as one:
        main(argv)
    assert one.value.code == (
        f"sft-train: cannot resume: checkpoint.resume: {not_a_checkpoint} is not an sft-train checkpoint "
        "(no extra-rank0.json in it)"
    )
    import sft_trainer.checkpoint

    monkeypatch.setattr(sft_trainer.checkpoint, "check_resume", lambda cfg, world: ["first problem", "second problem"])
    with pytest.raises(SystemExit) as several:
        main(argv)
    assert several.value.code == "sft-train: cannot resume:\n  - first problem\n  - second problem"
