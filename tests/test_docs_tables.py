"""Tables a script prints, as the docs show them: each block below is the command's output, verbatim (the study's
tables in docs/results.md have their own test, tests/test_study.py).

Run: pytest tests/test_docs_tables.py   (about 20 seconds)
"""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
from collapse import DOC_TABLES  # noqa: E402 (the pages `python examples/collapse.py --write-docs` rewrites)

TABLES = [(page, ["examples/collapse.py", *args]) for page, args in DOC_TABLES]


@pytest.mark.parametrize("page,command", TABLES, ids=[t[0] for t in TABLES])
def test_the_docs_show_what_the_script_prints(page, command):
    text = open(os.path.join(ROOT, page)).read()
    assert f"python {' '.join(command)}" in text  # the page names the command beside its table
    out = subprocess.run([sys.executable, *command], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.rstrip("\n") in blocks(text), f"{page}: no block holds the output of {' '.join(command)}:\n{out}"


def blocks(text):
    """The fenced code blocks of a markdown page, each as its lines joined (without the fences)."""
    out, current = [], None
    for line in text.splitlines():
        if line.startswith("```"):
            if current is None:
                current = []
            else:
                out.append("\n".join(current))
                current = None
        elif current is not None:
            current.append(line)
    return out
