"""The `jaxspec` command line, called in-process (`jaxspec.cli.main(argv)`) and once as a real process
for its exit codes. Settings match tests/demo_models.py, so the compiled steps are shared."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import jaxspec
from jaxspec.cli import main
from tests.demo_models import CLI_FLAGS, demo_model

REPO = Path(__file__).resolve().parents[1]
GENERATE = ["generate", "--model", "demo:qwen3", *CLI_FLAGS, "--max-new-tokens", "4"]


def run_main(argv: list[str]) -> int:
    """main's return value, or argparse's exit status."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


def test_help(capsys):
    assert run_main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "usage: jaxspec" in out and "generate" in out and "Qwen3" in out
    assert run_main(["generate", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # independent of the terminal width argparse wraps to
    for flag in ("--model", "demo:<family>", "demo-draft", "--max-new-tokens", "--temperature", "--top-k", "--top-p",
                 "--seed", "--max-model-len", "--dtype", "--kernels"):
        assert flag in out, flag


def test_no_command_is_an_error(capsys):
    assert run_main([]) == 2
    assert "required: COMMAND" in capsys.readouterr().err


def test_generate_prints_text_and_stats(capsys):
    assert run_main([*GENERATE, "hi"]) == 0
    captured = capsys.readouterr()
    text = jaxspec.generate(demo_model("qwen3"), "hi", max_new_tokens=4).texts[0]
    assert captured.out == f"hi{text}\n"
    assert "[jaxspec] 4 tokens in" in captured.err and "tok/s" in captured.err


@pytest.mark.parametrize(("kernels", "line"), [
    ("xla", "kernels: xla -> xla\n"),
    ("pallas", "kernels: pallas -> pallas; input projections (GDN, attention q / k / v, MLP gate / up) packed "
               "into one weight per layer"),
])
def test_info_names_the_kernels_and_packing(kernels, line, capsys):
    flags = [f for f in CLI_FLAGS if f not in ("--kernels", "xla")]
    assert run_main(["info", "--model", "demo:qwen3_5", *flags, "--kernels", kernels]) == 0
    assert line in capsys.readouterr().out


def test_generate_batches_several_prompts(capsys):
    assert run_main([*GENERATE, "hi", "hello there"]) == 0
    out = capsys.readouterr().out
    texts = jaxspec.generate(demo_model("qwen3"), ["hi", "hello there"], max_new_tokens=4).texts
    assert out == f"--- [0]\nhi{texts[0]}\n--- [1]\nhello there{texts[1]}\n"


@pytest.mark.parametrize("flags,message", [
    (["--max-new-tokens", "0"], "max-new-tokens=0 must be >= 1"),
    (["--max-new-tokens", "many"], "max-new-tokens='many' must be an integer"),
    (["--temperature", "-1"], "temperature=-1.0 must be a finite number >= 0"),
    (["--top-p", "0"], r"top_p=0.0 must be in (0, 1]"),
    (["--top-k", "-1"], "top_k=-1 must be an integer >= 0"),
    (["--max-new-tokens", "70"], "exceeds max_model_len=64"),
    (["--dtype", "fp8"], "invalid choice: 'fp8'"),
    (["--model", "demo:llama"], "unknown demo family 'llama'"),
])
def test_bad_flags_exit_nonzero_with_a_message(flags, message, capsys):
    assert run_main([*GENERATE, *flags, "hi"]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.out == ""


def test_missing_model_path(tmp_path, capsys):
    assert run_main(["generate", "--model", str(tmp_path / "nope"), "hi"]) == 2
    assert f"model path '{tmp_path / 'nope'}' does not exist" in capsys.readouterr().err


def test_module_entry_point_exit_codes(capsys):
    """`python -m jaxspec` in a real process: status 0 and the in-process output on success,
    non-zero with the message on stderr on failure."""
    env = dict(os.environ, PYTHONPATH=str(REPO))  # JAXSPEC_CACHE_DIR (tests/conftest.py) is inherited

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "jaxspec", *args], capture_output=True, text=True, env=env,
                              timeout=600)

    ok = run(*GENERATE, "hi")
    assert ok.returncode == 0, ok.stderr
    assert run_main([*GENERATE, "hi"]) == 0
    assert ok.stdout == capsys.readouterr().out
    bad = run(*GENERATE, "--temperature", "-1", "hi")
    assert bad.returncode == 2 and "temperature=-1.0 must be" in bad.stderr and bad.stdout == ""
