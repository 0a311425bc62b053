"""Every `python -m jaxdp...` command that README.md and docs/*.md show (code blocks and inline code, read when the
tests are collected, so a rewritten page is checked as it stands): its module exists and its argument parser
accepts the documented flags (parsed, not run; a command written as a template, `NAME [--quick] ...`, has each
of its flags checked); the cheap ones are also run at a tiny size, so a documented command cannot silently break."""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import importlib
import importlib.util
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMAND = re.compile(r"python3? -m (jaxdp[\w.]*)")
FENCE = re.compile(r"^\s*(```|~~~)")
SHELL_OPERATORS = {"&&", "||", ";", "|", "&", ">", ">>", "<", "(", ")", ">&", "2>&1"}
# a command written as a template: elisions, optional parts, alternatives, <placeholders>, $VARIABLES, words
# in capitals (NAME, DIR, FILE.npz; not H200: a GPU's name)
TEMPLATE = re.compile(r"\.\.\.|…|[\[\]<>{}]|\w\|\w|\$\w|(?:^|\s)[A-Z][A-Z_]*(?:\.\w+)?(?=\s|$)")
# modules whose main passes the flags it does not know to another command's parser
FORWARDS_UNKNOWN_FLAGS_TO = {"jaxdp.experiments": "jaxdp.serve"}


@dataclasses.dataclass(frozen=True)
class Command:
    """One documented command: where it is shown, the module `-m` runs and the arguments after it."""

    where: str  # page:line
    module: str
    argv: tuple[str, ...]
    text: str
    inline: bool  # in a sentence (it may name a command without its required flags) or in a code block
    output: tuple[str, ...] = ()  # the lines a code block shows after a `$ command` line, up to the next `$ `

    @property
    def template(self) -> bool:
        return bool(TEMPLATE.search(self.text))


def code_pieces(text: str) -> list[tuple[int, str, bool, list[str]]]:
    """(line, code, inline, output) for each piece of code of a markdown page: a line of a fenced block (a line
    ending in a backslash joined with the next; after a `$ command` line, the lines up to the next `$ ` are its
    output), an indented code line, an inline code span (which may wrap over lines)."""
    pieces, prose, in_fence, pending, pending_line = [], [], False, "", 0
    output: list[str] | None = None  # the output lines of the block's last `$ command`
    for n, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            in_fence, output = not in_fence, None
            prose.append((n, ""))
            continue
        if in_fence and output is not None and not line.startswith("$ ") and not pending:
            output.append(line)
            prose.append((n, ""))
            continue
        if in_fence or (line.startswith("    ") and COMMAND.search(line) and "`" not in line):
            pending_line = pending_line or n
            pending += line.rstrip()
            prose.append((n, ""))
            if pending.endswith("\\"):
                pending = pending[:-1] + " "
                continue
            output = [] if in_fence and pending.startswith("$ ") else None
            pieces.append((pending_line, pending, False, output if output is not None else []))
            pending, pending_line = "", 0
        else:
            prose.append((n, line))
    paragraph: list[tuple[int, str]] = []
    for n, line in [*prose, (0, "")]:
        if line.strip():
            paragraph.append((n, line))
            continue
        joined, starts = "", []
        for k, part in paragraph:
            starts.append((len(joined), k))
            joined += part + " "
        for m in re.finditer(r"`([^`]+)`", joined):
            pieces.append((max(k for at, k in starts if at <= m.start()), m.group(1), True, []))
        paragraph = []
    return pieces


def commands_in(piece: str) -> list[tuple[str, list[str], str]]:
    """(module, argv, text) of each `python -m jaxdp...` in a piece of code, its arguments up to a shell operator
    or a comment."""
    out = []
    for m in COMMAND.finditer(piece):
        text = piece[m.start():]
        lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        try:
            tokens = list(lexer)
        except ValueError:  # an unclosed quote: the span ends inside the command
            tokens = text.split()
        argv = []
        for token in tokens[3:]:
            if token in SHELL_OPERATORS or token.startswith("#"):
                break
            argv.append(token)
        end = text.find(" #")
        out.append((m.group(1), argv, text[:end] if end > 0 else text))
    return out


def documented_commands() -> list[Command]:
    found: dict[tuple[str, tuple[str, ...]], Command] = {}
    for page in PAGES:
        for line, piece, inline, output in code_pieces(page.read_text()):
            for module, argv, text in commands_in(piece):
                found.setdefault((module, tuple(argv)), Command(f"{page.name}:{line}", module, tuple(argv), text,
                                                                inline, tuple(o for o in output if o.strip())))
    return list(found.values())


COMMANDS = documented_commands()


def runs_as(module: str) -> str:
    """The module whose `main` `python -m module` runs: the module, or for a package the module its __main__.py
    takes `main` from (read, not imported: a __main__.py may run its command when imported)."""
    spec = importlib.util.find_spec(module)
    assert spec is not None, f"no module {module}"
    if spec.submodule_search_locations is None:
        return module
    main_py = Path(next(iter(spec.submodule_search_locations))) / "__main__.py"
    assert main_py.is_file(), f"{module} is a package without __main__.py"
    for node in ast.walk(ast.parse(main_py.read_text())):
        if isinstance(node, ast.ImportFrom) and any(a.name == "main" for a in node.names) and node.module:
            return node.module
    return f"{module}.__main__"


class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


def parser_of(module: str) -> argparse.ArgumentParser:
    """The argument parser of `python -m module`: its `build_parser()` (or `make_parser()`), or that of the module
    its `main` comes from; else the parser its `main` builds, caught as it starts to parse (nothing runs after)."""
    mod = importlib.import_module(runs_as(module))
    main = getattr(mod, "main", None)
    for owner in (mod, sys.modules.get(getattr(main, "__module__", ""), mod)):
        for name in ("build_parser", "make_parser"):
            if callable(getattr(owner, name, None)):
                return getattr(owner, name)()
    assert callable(main), f"{module} has neither build_parser() nor main(argv)"

    def caught(self, *args, **kwargs):
        raise _Parsed(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(argparse.ArgumentParser, "parse_args", caught)
        mp.setattr(argparse.ArgumentParser, "parse_known_args", caught)
        try:
            main([])
        except _Parsed as p:
            return p.parser
    raise AssertionError(f"{module}'s main(argv) parsed no arguments")


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """parse_known_args, with an error (SystemExit or a module's own exception) turned into AssertionError; `--help`
    (which prints and exits 0) parses."""
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
            return parser.parse_known_args(argv)
    except SystemExit as e:
        if e.code == 0:
            return argparse.Namespace(), []
        raise AssertionError(f"the parser exits ({err.getvalue().strip().splitlines()[-1:]})") from None
    except Exception as e:  # noqa: BLE001 (modules raise their own error for a bad command line)
        raise AssertionError(str(e)) from None


def flags_of(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings}


@pytest.mark.parametrize("cmd", COMMANDS, ids=[f"{c.where} {c.module}" for c in COMMANDS])
def test_a_documented_command_parses(cmd: Command):
    parser = parser_of(cmd.module)
    forward = FORWARDS_UNKNOWN_FLAGS_TO.get(cmd.module)
    try:
        _, unknown = parse(parser, list(cmd.argv))
        if forward:
            _, unknown = parse(parser_of(forward), unknown)
        assert not unknown, f"unknown arguments {unknown}"
    except AssertionError as e:
        named_only = cmd.inline and "arguments are required" in str(e)  # a sentence naming the command
        if not (cmd.template or named_only):
            raise AssertionError(f"{cmd.where}: `{cmd.text}`: {e}") from None
        # a template or a mention: each flag it names must be a flag of the command (or of the one it forwards
        # them to)
        known = flags_of(parser) | (flags_of(parser_of(forward)) if forward else set())
        named = {t.split("=", 1)[0] for t in re.findall(r"(?<![\w-])--[a-z][\w-]*(?:=\S*)?", cmd.text)}
        assert not named - known, f"{cmd.where}: `{cmd.text}` names flags {sorted(named - known)} it does not have"


# ---- running the cheap ones ----------------------------------------------------------------------------------


def host_only_engine_ran(out: Path, stdout: str) -> None:
    results = json.loads((out / "engine.json").read_text())["results"]
    assert results and all(r["output_tokens"] > 0 and r["tokens_per_s"] > 0 for r in results), results
    assert (out / "engine.png").read_bytes()[:4] == b"\x89PNG"


def prompt_in_the_way_measured(out: Path, stdout: str) -> None:
    """Every test measured the decoders alone and while the prompts arrived (both windows positive), and all the
    prompts were read: a decoder that ran out of tokens before the prompts' phase ended would report 100% lost."""
    r = json.loads((out / "prompt-in-the-way.json").read_text())
    for name, t in r["tests"].items():
        assert t["alone_s"] > 0 and t["prompts_s"] > 0, (name, t)
        assert t["rate_alone"] > 0 and t["rate_prompts"] > 0 and t["lost_pct"] < 100, (name, t)
        assert t["prompts_done"] == t["prompts_sent"] > 0, (name, t)


def one_batch_ran(out: Path, stdout: str) -> None:
    assert "prefill:" in stdout and "decode:" in stdout, stdout
    assert list(out.glob("*.npz")), "no logits written"


def printed(*words: str) -> Callable[[Path, str], None]:
    def check(out: Path, stdout: str) -> None:
        assert all(w in stdout for w in words), stdout[-2000:]
    return check


@dataclasses.dataclass(frozen=True)
class Cheap:
    """A form of documented command that runs in seconds at a tiny size: `module` with every word of `selects`
    and none of `unless` among its arguments; run with `shrink` appended (argparse: a later flag wins; `{out}` is
    the run's output folder), then `check(out, stdout)`."""

    module: str
    selects: tuple[str, ...]
    shrink: tuple[str, ...]
    check: Callable[[Path, str], None]
    unless: tuple[str, ...] = ()
    timeout_s: float = 120
    slow: bool = False  # minutes, not seconds: run with -m slow

    def matches(self, cmd: Command) -> bool:
        return (cmd.module == self.module and not cmd.template and all(w in cmd.argv for w in self.selects)
                and not any(w in cmd.argv for w in self.unless))


CHEAP = [
    Cheap("jaxdp.bench.engine", ("--host-only",), ("--concurrency", "8,16", "--input-len", "8", "--output-len", "8",
                                                   "--json", "{out}/engine.json", "--plot", "{out}/engine.png"),
          host_only_engine_ran),
    # the experiment at its --quick size whatever the page shows (a full run takes minutes more): two servers,
    # the first compiling its steps into the tests' cache, the second reading them from it
    Cheap("jaxdp.experiments", ("prompt-in-the-way",), ("--quick", "--output-dir", "{out}", "--json-dir", "{out}"),
          prompt_in_the_way_measured, timeout_s=600, slow=True),
    # one layout (the first run also builds the native CPU kernels into the tests' cache)
    Cheap("jaxdp.one_batch", ("--prompt-ids", "--mesh"), ("--dump-logits", "{out}/logits.npz"), one_batch_ran,
          unless=("--model-path", "--ranks"), timeout_s=300),
    Cheap("jaxdp.plan", ("--model",), (), printed("attention groups"), unless=("--compile",)),
    Cheap("jaxdp.serve", ("--help",), (), printed("--mesh", "--attn-dp-size")),
    Cheap("jaxdp.bench.roofline", (), (), printed("GB/s", "GFLOP/s")),
]
# what a cheap form's run would need beyond a test's minute (a GPU, vLLM, SGLang's router): the command is parsed
# above, and its run skipped here, naming what runs it
NEEDS = {"--disaggregated": "three servers and SGLang's router: tests/test_disagg_experiment.py runs it (-m slow)"}


def runs() -> list[tuple[Command, Cheap]]:
    """Each documented command of a cheap form, once per distinct run."""
    seen, out = set(), []
    for cmd in COMMANDS:
        for form in CHEAP:
            if form.matches(cmd):
                key = (cmd.module, *cmd.argv, *form.shrink)
                if form.module == "jaxdp.experiments":  # (the pages' output folders differ; the runs do not)
                    key = (cmd.module, *[a for a in cmd.argv if a.startswith("--") and a not in ("--output-dir",
                                                                                                 "--json-dir")])
                if key not in seen:
                    seen.add(key)
                    out.append((cmd, form))
                break
    return out


RUNS = runs()


def test_every_cheap_form_is_still_documented():
    """A form no page shows any more is stale here: the run it stood for would silently stop."""
    unmatched = [f"{f.module} {' '.join(f.selects)}" for f in CHEAP if not any(f.matches(c) for c in COMMANDS)]
    assert not unmatched, f"no page shows a command of these forms any more: {unmatched}"


@pytest.mark.parametrize("cmd, form", [pytest.param(c, f, marks=[pytest.mark.slow] if f.slow else [],
                                                   id=f"{c.where} {c.module} {' '.join(c.argv)}"[:90])
                                      for c, f in RUNS])
def test_a_cheap_documented_command_runs(cmd: Command, form: Cheap, tmp_path):
    if reason := next((why for word, why in NEEDS.items() if word in cmd.argv), None):
        pytest.skip(f"{cmd.where}: {reason}")
    out = tmp_path / "out"
    out.mkdir()
    work = tmp_path / "cwd"  # relative paths the page names: files it reads copied here, what it writes stays here
    work.mkdir()
    for arg in cmd.argv:
        src = ROOT / arg
        if not arg.startswith("-") and "/" in arg and src.is_file():
            (work / arg).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src, work / arg)
    argv = [*cmd.argv, *(a.replace("{out}", str(out)) for a in form.shrink)]
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", cmd.module, *argv], cwd=work, env=env, capture_output=True, text=True,
                       timeout=form.timeout_s)
    said = f"{cmd.where}: `{shlex.join(['python', '-m', cmd.module, *argv])}`:\n{r.stderr[-3000:]}"
    if any("error:" in line for line in cmd.output):  # the page shows the command refused: exactly so
        assert r.returncode == 2, said
        assert all(line.strip() in r.stderr for line in cmd.output), said
        return
    assert r.returncode == 0, said
    assert all(line.strip() in r.stdout for line in cmd.output if "..." not in line), (cmd.output, r.stdout)
    form.check(out, r.stdout)


def test_the_product_needs_none_of_the_benchmarks_packages():
    """`pip install -e .` serves, plans and trains: no module outside jaxdp.bench and jaxdp.experiments imports
    jaxdp[bench]'s packages (aiohttp, matplotlib) or the benchmarks themselves when it is imported (a package's
    __main__, which runs its command when imported, is left out)."""
    code = """
import importlib, pathlib, sys
for name in ("aiohttp", "matplotlib"):
    sys.modules[name] = None  # an import of it raises ImportError
for path in sorted(pathlib.Path("jaxdp").rglob("*.py")):
    name = ".".join(path.with_suffix("").parts).removesuffix(".__init__")
    if not name.startswith(("jaxdp.bench", "jaxdp.experiments")) and not name.endswith(".__main__"):
        importlib.import_module(name)
bench = sorted(n for n in sys.modules if n.startswith(("jaxdp.bench", "jaxdp.experiments")))
assert not bench, bench
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=os.environ | {"PYTHONPATH": str(ROOT)})
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]
