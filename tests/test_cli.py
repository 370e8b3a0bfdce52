"""`python -m helpers`: every argument is checked by the parser, before any work, with a one-line error and exit 2."""

import pytest

from helpers.__main__ import COMMANDS as TABLE
from helpers.__main__ import main

BAD_ARGUMENTS = [
    (["bench-attention", "--seq", "0"], "argument --seq: invalid integer >= 1 value: '0'"),
    (["bench-attention", "--batch", "0"], "argument --batch: invalid integer >= 1 value: '0'"),
    (["bench-attention", "--heads", "0"], "argument --heads: invalid integer >= 1 value: '0'"),
    (["bench-attention", "--d-model", "0"], "argument --d-model: invalid integer >= 1 value: '0'"),
    (["bench-attention", "--seq", "-5"], "argument --seq: invalid integer >= 1 value: '-5'"),
    (["bench-attention", "--heads", "5", "--d-model", "64"], "--heads 5 does not divide --d-model 64"),
    (["bench-attention", "--min-run-time", "0"], "argument --min-run-time: invalid number > 0 value: '0'"),
    (["bench-attention", "--min-run-time", "nan"], "argument --min-run-time: invalid number > 0 value: 'nan'"),
    (["flops", "--batch", "0"], "argument --batch: invalid integer >= 1 value: '0'"),
    (["flops", "--model", "gpt2-small", "--ctx", "4096"], "pass --ctx 1024 or less"),
    (["bench-load", "--repeats", "0"], "argument --repeats: invalid integer >= 1 value: '0'"),
    (["bench-serve", "--max-batch", "0"], "argument --max-batch: invalid integer >= 1 value: '0'"),
    (["bench-serve", "--num-blocks", "-1"], "argument --num-blocks: invalid integer >= 1 value: '-1'"),
    (["bench-serve", "--repeats", "0"], "argument --repeats: invalid integer >= 1 value: '0'"),
    (["bench-serve", "--prefix-tokens", "8"], "--prefix-tokens is for --workload shared-prefix"),
    (["bench-serve", "--workload", "shared-prefix", "--prefix-tokens", "100000"], "prefix_tokens must be between"),
    (["bench-decode", "--batch", "0"], "argument --batch: invalid integer >= 1 value: '0'"),
    (["bench-decode", "--setups", "paged"], "argument --setups: invalid choice: 'paged'"),
    (["bench-train", "--model", "gpt-smoke", "--ctx", "65"], "pass --ctx 64 or less"),
    (["bench-train", "--ctx", "0"], "argument --ctx: invalid integer >= 1 value: '0'"),
    (["bench-train", "--batch", "0"], "argument --batch: invalid integer >= 1 value: '0'"),
    (["bench-train", "--steps", "0"], "argument --steps: invalid integer >= 1 value: '0'"),
    (["bench-train", "--warmup", "0"], "argument --warmup: invalid integer >= 1 value: '0'"),
    (["bench-train", "--accumulation", "x"], "argument --accumulation: invalid integer >= 1 value: 'x'"),
    (["run-notebooks", "--timeout", "0"], "argument --timeout: invalid integer >= 1 value: '0'"),
    (["run-notebooks", "--core", "ch02_text/01_tokenization.ipynb"], "not allowed with argument --core"),
]


def test_no_command_names_the_commands(capsys):
    with pytest.raises(SystemExit) as exit_:
        main([])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "a command is required, one of: env, calibrate" in err and "record, sync-bootstrap" in err


@pytest.mark.parametrize("argv, message", BAD_ARGUMENTS, ids=[" ".join(a) for a, _ in BAD_ARGUMENTS])
def test_bad_arguments_are_usage_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--device", "cpu"] if argv[0].startswith("bench-") else argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: ")
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"python -m helpers {argv[0]}: error: ") and message in last, last
    assert "Traceback" not in err


def test_a_usage_error_exits_2_without_a_traceback_from_the_shell(python_process):
    done = python_process("-m", "helpers", "bench-load", "--repeats", "0", timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].endswith("argument --repeats: invalid integer >= 1 value: '0'")


@pytest.mark.parametrize("argv", [["env"], ["flops", "--model", "gpt-smoke", "--batch", "1", "--ctx", "8"],
                                  ["bench-load", "--help"]])
def test_commands_print_no_warnings_of_the_libraries_they_use(python_process, argv):
    """What a user sees, with Python's default warning filters (torch 2.14 turned a deprecation of fvcore's into a
    FutureWarning, which is shown)."""
    done = python_process("-m", "helpers", *argv)
    assert done.returncode == 0, done.stderr
    assert "Warning" not in done.stderr, done.stderr


COMMANDS = [command.name for command in TABLE]
# what only some commands run: nbformat (with jsonschema, a second of imports) only the notebook commands
BENCHMARK_LIBRARIES = ("fvcore", "transformers", "triton", "torchao", "matplotlib", "nbclient", "nbformat",
                       "jsonschema", "fastapi", "uvicorn", "prometheus_client", "httpx")


def test_help_imports_no_benchmark_library(python_process):
    """`--help` answers in about the time of `import torch`: building the parser imports no benchmark library
    (fvcore, transformers, triton: seconds each). One fresh process asks every command's help in turn and lists,
    after each, the libraries imported so far: a command that imports one shows it on its own line first."""
    script = ("import sys\nfrom helpers.__main__ import main\nfor command in sys.argv[1:]:\n    try:\n"
              "        main([command, '--help'])\n    except SystemExit:\n        pass\n"
              f"    print(command, 'imported:', *(m for m in {BENCHMARK_LIBRARIES!r} if m in sys.modules))")
    done = python_process("-c", script, *COMMANDS, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if " imported:" in line]
    assert [line.split()[0] for line in lines] == COMMANDS, done.stdout[-2000:]
    for line in lines:
        assert line.endswith("imported:"), f"--help of {line}"


def test_scale_defaults_are_written_once_and_shown_by_help(capsys, monkeypatch):
    """The help text and the values a command runs with both come from the command's scale_defaults."""
    from helpers.measure.serving_bench import COMMAND
    from helpers.system.cli import fill_scale_defaults

    with pytest.raises(SystemExit):
        main(["bench-serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "(default by scale: smoke 16, cpu 64, gpu 256)" in out
    monkeypatch.setenv("COURSE_SMOKE", "1")
    args = type("Args", (), dict(device="cpu", model=None, requests=None, max_batch=3, block_size=None))()
    fill_scale_defaults(args, COMMAND)
    smoke = COMMAND.scale_defaults["smoke"]
    assert (args.model, args.requests, args.max_batch, args.block_size) == (smoke["model"], smoke["requests"], 3,
                                                                            smoke["block_size"])


def test_chapter_scripts_name_the_model_as_the_command_line_does():
    """The ch07 scripts and `python -m helpers` share flag names: --model (a preset), --ctx, --accumulation."""
    import argparse

    from helpers.parallel.runtime import add_common_args

    parser = argparse.ArgumentParser()
    add_common_args(parser)
    args = parser.parse_args(["--out", "x.json", "--model", "gpt-cpu", "--ctx", "32"])
    assert (args.model, args.ctx) == ("gpt-cpu", 32)
    for other in (["--preset", "gpt-cpu"], ["--context", "32"], ["--ctx", "0"], ["--model", "gpt-9"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["--out", "x.json", *other])


def test_a_notebook_reads_the_model_flags_as_the_chapter_scripts_do():
    """ch07/04 and 05 once rebuilt the config from the flags by hand and dropped --ffn; they now ask the scripts'
    parser."""
    from helpers.model.config import GPTConfig
    from helpers.parallel.runtime import config_from_flags

    config = config_from_flags(["--model", "gpt-smoke", "--layers", "3", "--ctx", "32", "--ffn", "swiglu"])
    assert config == GPTConfig.from_preset("gpt-smoke", dropout=0.0, n_layers=3, context_length=32, ffn_type="swiglu")
    assert config_from_flags([]) == GPTConfig.from_preset("gpt-smoke", dropout=0.0)
    with pytest.raises(SystemExit):
        config_from_flags(["--layers", "0"])
