"""The documentation runs (issue 8): every ```python and ```bash block of README.md and
docs/user_guide.md executes on the demo models (python blocks in one namespace per document, in
order; `jaxspec ...` lines in-process through jaxspec.cli.main), except blocks whose info string says
`notest`. The README opens with the two set-up commands; every CLI flag and API argument is
documented; the CLI's --help works and bad flags fail with a clear message and a non-zero exit."""

from __future__ import annotations

import dataclasses
import inspect
import re
import shlex
import shutil
from pathlib import Path

import pytest

import jaxspec
from jaxspec import cli

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
GUIDE = REPO / "docs" / "user_guide.md"
SETUP_COMMANDS = [
    'pip install -e . && jaxspec generate --model demo --max-new-tokens 32 "def fibonacci(n):"',
    'pip install -e ".[test]" && python -m pytest -q -n 2 --dist loadfile',
]
FENCE = re.compile(r"^```(\w*)([^\n]*)\n(.*?)^```[ \t]*$", re.M | re.S)
@dataclasses.dataclass
class Block:
    lang: str
    tags: tuple[str, ...]
    code: str
    line: int  # 1-based line of the opening fence

    @property
    def runs(self) -> bool:
        return self.lang in ("python", "bash") and "notest" not in self.tags


def blocks(path: Path) -> list[Block]:
    text = path.read_text()
    return [Block(m.group(1), tuple(m.group(2).split()), m.group(3), text.count("\n", 0, m.start()) + 1)
            for m in FENCE.finditer(text)]


def run_cli(argv: list[str]) -> int:
    """jaxspec.cli.main in-process; argparse's --help and usage errors exit through SystemExit."""
    try:
        return cli.main(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1


def run_document(path: Path) -> int:
    """Execute a document's runnable blocks in order; returns how many ran."""
    namespace: dict = {"__name__": f"docs:{path.name}"}
    ran = 0
    for block in filter(lambda b: b.runs, blocks(path)):
        where = f"{path.relative_to(REPO)}:{block.line}"
        if block.lang == "python":
            exec(compile(block.code, where, "exec"), namespace)  # noqa: S102 - the docs are the test input
        for line in block.code.splitlines() if block.lang == "bash" else []:
            line = line.strip()
            if not line or line.startswith("#") or line.startswith("pip "):
                continue  # installs are not run here; README's are checked literally below
            assert line.startswith("jaxspec "), f"{where}: cannot run {line!r}; mark the block `bash notest`"
            assert run_cli(shlex.split(line)[1:]) == 0, f"{where}: {line!r} failed"
        ran += 1
    return ran


# ---- the documents run -------------------------------------------------------------------------

def test_readme_starts_with_the_setup_commands():
    text = README.read_text()
    first = blocks(README)[:2]
    assert [(b.lang, b.code.strip()) for b in first] == [("bash", cmd) for cmd in SETUP_COMMANDS]
    heading = text.find("\n## ")
    assert all(text.count("\n", 0, heading) > b.line for b in first), "the set-up commands come first"
    assert text.startswith("# jaxspec\n")


def test_readme_examples_run(capsys):
    assert run_document(README) >= 4
    out = capsys.readouterr().out
    assert "tokens in" in out and "usage: jaxspec" in out


def test_user_guide_examples_run(capsys):
    assert run_document(GUIDE) >= 15
    out = capsys.readouterr().out
    assert "k=4: kv_pages" in out and "bucket table" in out


@pytest.mark.parametrize("path", [README, GUIDE], ids=lambda p: p.name)
def test_fences_are_tagged_and_links_resolve(path):
    for block in blocks(path):
        assert block.lang in ("python", "bash", ""), f"{path.name}:{block.line}: unknown fence {block.lang!r}"
        assert set(block.tags) <= {"notest"}, f"{path.name}:{block.line}: unknown fence tags {block.tags}"
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
        if "://" in target:
            continue
        resolved = (path.parent / target).resolve()
        assert resolved.exists(), f"{path.name} links to missing {target}"


# ---- the documentation covers the surface -------------------------------------------------------

def cli_flags() -> dict[str, list[str]]:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return {name: [s for a in p._actions for s in a.option_strings if s.startswith("--") and s != "--help"]
            for name, p in sub.choices.items()}


def test_every_cli_flag_is_documented():
    guide = GUIDE.read_text()
    missing = {(cmd, flag) for cmd, flags in cli_flags().items() for flag in flags if f"`{flag}`" not in guide}
    assert not missing, f"undocumented CLI flags: {sorted(missing)}"


def test_every_api_argument_is_documented():
    guide = GUIDE.read_text()
    names = [*inspect.signature(jaxspec.generate).parameters, *inspect.signature(jaxspec.load).parameters,
             *inspect.signature(jaxspec.score).parameters,
             *(f.name for f in dataclasses.fields(jaxspec.SpeculativeConfig)),
             *(f.name for f in dataclasses.fields(jaxspec.GenerateStats))]
    missing = [n for n in names if f"`{n}`" not in guide and not re.search(rf"`[^`]*\b{n}\b[^`]*`", guide)]
    assert not missing, f"undocumented arguments: {missing}"


# ---- CLI usage: --help everywhere, clear errors on bad flags -----------------------------------

# tests/test_cli.py covers `jaxspec --help`, `jaxspec generate --help`, a missing command and the
# generate sampling / length / dtype / model refusals; tests/test_compile.py covers precompile's --k 0,
# --max-num-seqs 0, a missing model path and an unwritable cache dir. Below: the rest.

@pytest.mark.parametrize("command", ["precompile", "info"])
def test_help(command, capsys):
    assert run_cli([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: jaxspec {command}")
    for flag in cli_flags()[command]:
        assert flag in out


BAD_FLAGS = {
    "unknown command": (["serve"], "invalid choice: 'serve'"),
    "no prompt": (["generate"], "required: prompt"),
    "unknown flag": (["generate", "--fast", "hi"], "unrecognized arguments: --fast"),
    "zero max-model-len": (["info", "--max-model-len", "0"], "max-model-len=0 must be >= 1"),
    "not a float": (["generate", "--temperature", "hot", "hi"], "invalid float value: 'hot'"),
    "bad method": (["generate", "--speculative", "magic", "hi"], "invalid choice: 'magic'"),
    "bad k-mode": (["precompile", "--k-mode", "dynamic"], "invalid choice: 'dynamic'"),
    "draft_model without a draft": (["generate", "--model", "demo:qwen3", "--speculative", "draft_model", "hi"],
                                    "--speculative draft_model needs --draft-model PATH"),
    "precompile draft_model without a draft": (["precompile", "--model", "demo:qwen3", "--k", "2", "--method",
                                                "draft_model"], "--method draft_model needs --draft-model PATH"),
    "chat without a template": (["generate", "--model", "__no_template__", "--chat", "hi"], "has no chat template"),
}


@pytest.mark.parametrize("case", sorted(BAD_FLAGS))
def test_bad_flags_fail_clearly(case, capsys, tmp_path, hf_checkpoint):
    argv, message = BAD_FLAGS[case]
    if "__no_template__" in argv:  # an HF checkpoint whose tokenizer has no chat template
        shutil.copytree(hf_checkpoint("qwen3"), tmp_path / "ckpt")
        word_level_tokenizer().save(str(tmp_path / "ckpt" / "tokenizer.json"))
        argv = [str(tmp_path / "ckpt") if a == "__no_template__" else a for a in argv]
    assert run_cli(argv) != 0
    err = capsys.readouterr().err
    assert message in err, err
    assert "Traceback" not in err


def word_level_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"hi": 0, "[UNK]": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok
