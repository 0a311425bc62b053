"""docs/api.md lists every flag of `python -m jaxdp.serve` as its parser defines it (`flags_markdown()`, read from
`jaxdp.serve.build_parser()`): a flag added, removed or reworded fails this test until the page is regenerated
(`python tests/test_api_flags_doc.py` prints the section)."""

from __future__ import annotations

import argparse
from pathlib import Path

from jaxdp.serve import build_parser

ROOT = Path(__file__).resolve().parent.parent


def _takes(action: argparse.Action) -> str:
    if action.nargs == 0:
        return "a switch"
    if action.choices:
        return " / ".join(str(c) for c in action.choices)
    return action.metavar or action.dest.upper()


def flags_markdown() -> str:
    """One table per group of the parser: each flag, what it takes, its help (every flag is honoured: a flag the
    parser does not define is refused at start-up)."""
    out = []
    parser = build_parser()
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a.option_strings and a.help != argparse.SUPPRESS
                   and not isinstance(a, argparse._HelpAction)]
        if not actions:
            continue
        out += [f"#### {group.title}", "", "| flag | takes | what it does |", "| --- | --- | --- |"]
        for a in actions:
            help_text = (a.help or "").replace("%(default)s", str(a.default)).replace("%%", "%")
            names = ", ".join(f"`{s}`" for s in a.option_strings)
            out.append(f"| {names} | {_takes(a).replace('|', '/')} | {' '.join(help_text.split()).replace('|', '/')} |")
        out.append("")
    return "\n".join(out)


def test_docs_api_lists_every_server_flag():
    assert flags_markdown() in (ROOT / "docs" / "api.md").read_text(), \
        "regenerate docs/api.md's server flags from flags_markdown() (python tests/test_api_flags_doc.py)"


if __name__ == "__main__":
    print(flags_markdown())
