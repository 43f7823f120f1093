"""The docs cite the project's code by function, and each citation says no more than this test checks.

A citation is `file.py: name()` in backticks, in README.md and docs/*.md: a file of the repository (one in
minigdpo/ named without the folder) and a function in it; `Class.method()` for a method, `outer.inner()` for a
function defined inside another. Read with `ast`, never run:

- the file holds that function;
- "`f()` in `file.py: g()`" (or in a list of citations joined by commas, "and" or "or") means g calls f: some
  ast.Call in g's own body (its lambdas included, the functions defined inside it not) calls a name or an
  attribute f, and "`a.f()`" an attribute f of `a` (of any object for a class's, `DTensor.full_tensor()`);
  for `dist.f()`, dist.py defines f;
- the table of collectives in docs/gpus.md: in each row, the 'issued at' cell's first citation, and each citation
  after "through", form a chain in which each function calls the next; the last makes the calls the 'collective'
  cell names with parentheses. A `dist.py` wrapper among them (`dist.all_gather()`) calls in turn the torch call
  the cell names with parentheses (`dcp.save()`, `DTensor.full_tensor()`) or else the torch.distributed function
  the cell names first (`all_gather`), twice where the cell says so;
- no line number of a project file is left (`file.py:123`, or a link's `file.py#L123`): only other projects' files,
  whose lines a release pins, are cited by line, under the prefixes in OTHER_PROJECTS.

Calls are matched by name (and the object they are called on): that `model()` runs FSDP2's hooks, or what a
collective moves and when, is not checked here (docs/gpus.md says how those were traced).

Run: pytest tests/test_docs_citations.py   (about a second)
"""

import ast
import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
OTHER_PROJECTS = ("vllm/", "trl/")  # `vllm/v1/worker/gpu_worker.py:413` is vLLM's line, of the version the page names

NAME = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*"
CITE = re.compile(rf"`((?:[\w-]+/)*[\w-]+\.py): ({NAME})\(\)`")                   # `rollout.py: rollout()`
CALL = re.compile(rf"`({NAME})\(\)`")                                              # `dist.all_gather()`
CALL_IN = re.compile(rf"`({NAME})\(\)` in ({CITE.pattern}(?:(?:,| and| or|, and|, or) {CITE.pattern})*)")
LINE = re.compile(r"(?<![\w./:-])[\w./-]*\w\.py(?::|#L)\d+")  # rollout.py:80, a link's rollout.py#L80; not a URL's
DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def page_text(page):
    return open(os.path.join(ROOT, page)).read()


def resolve(path):
    """The repository file a citation names: as written, or in minigdpo/ (one of the two, not both)."""
    candidates = [path] if "/" in path else [path, os.path.join("minigdpo", path)]
    found = [os.path.join(ROOT, p) for p in candidates if os.path.isfile(os.path.join(ROOT, p))]
    assert len(found) == 1, f"{path}: {'no file' if not found else 'two files'} of that name"
    return found[0]


def own_nodes(node):
    """The nodes of node's own body: not those of a function or class defined inside it (their def nodes are)."""
    for child in ast.iter_child_nodes(node):
        yield child
        if not isinstance(child, DEFS):
            yield from own_nodes(child)


_trees = {}


def definition(path, name):
    """The ast node of `name` (dotted: Class.method, outer.inner) in the file `path` names."""
    full = resolve(path)
    if full not in _trees:
        _trees[full] = ast.parse(open(full).read())
    node = _trees[full]
    for part in name.split("."):
        found = [n for n in own_nodes(node) if isinstance(n, DEFS) and n.name == part]
        assert len(found) == 1, f"`{path}: {name}()`: {len(found)} definitions of {part}"
        node = found[0]
    return node


def calls(fn, call):
    """How many calls in fn's own body match `call`: its last name, called as a function or an attribute, and on the
    object its qualifier names (`dist.all_gather`: on `dist`; `self.model`: on `self`), except a class's (the call
    `DTensor.full_tensor` is on some object, whose type ast does not know)."""
    *owner, name = call.split(".")

    def matches(f):
        if isinstance(f, ast.Name):
            return f.id == name and not owner
        if isinstance(f, ast.Attribute) and f.attr == name:
            return not owner or owner[0][0].isupper() or ast.unparse(f.value) == ".".join(owner)
        return False

    return sum(isinstance(node, ast.Call) and matches(node.func) for node in own_nodes(fn))


def assert_calls(path, fn_name, call, times=None):
    """`path: fn_name()` calls `call` (a wrapper that dist.py defines, for dist.*), at least once or `times` times."""
    if call.startswith("dist."):
        definition("dist.py", call[len("dist."):])
    n = calls(definition(path, fn_name), call)
    assert n if times is None else n == times, \
        f"`{path}: {fn_name}()` makes {n} calls to {call}(), the docs say {times or 'at least one'}"


def citations(text):
    return [(m.group(1), m.group(2)) for m in CITE.finditer(text)]


def test_every_citation_names_a_function_that_is_there():
    found = 0
    for page in PAGES:
        for path, name in citations(page_text(page)):
            definition(path, name)
            found += 1
    assert found >= 50  # the collectives table alone holds more: a change of form that the pattern misses fails


def test_no_line_number_of_a_project_file_is_left():
    for page in PAGES:
        for cite in LINE.findall(page_text(page)):
            assert cite.startswith(OTHER_PROJECTS), (f"{page}: {cite} cites a line, which the next edit moves: "
                                                     "cite the function, `file.py: name()`")


def test_a_call_in_a_function_is_there():
    """"`f()` in `file.py: g()`": g calls f."""
    checked = 0
    for page in PAGES:
        text = re.sub(r"\s+", " ", page_text(page))  # a sentence may wrap
        for m in CALL_IN.finditer(text):
            for path, name in citations(m.group(2)):
                assert_calls(path, name, m.group(1))
                checked += 1
    assert checked >= 8


def collectives_table():
    """[(collective cell, issued-at cell)] of docs/gpus.md's table of collectives."""
    rows, columns = [], None
    for line in page_text("docs/gpus.md").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else None
        if cells and "issued at" in cells and "collective" in cells:
            columns = cells.index("collective"), cells.index("issued at")
        elif cells and columns and not set(line) <= set("|- "):
            rows.append((cells[columns[0]], cells[columns[1]]))
        elif not cells:
            columns = None
    return rows


def test_each_collective_is_issued_where_the_table_says():
    rows = collectives_table()
    assert len(rows) >= 30
    checked = 0
    for collective, issued in rows:
        sites = [(m, issued[:m.start()].rstrip()) for m in CITE.finditer(issued)]
        if not sites:
            assert collective.startswith("none"), f"a collective without a citation: {collective}"
            continue
        chain = [m.groups() for i, (m, before) in enumerate(sites) if i == 0 or before.endswith("through")]
        for (path, name), (_, callee) in zip(chain, chain[1:]):  # each function of the chain calls the next
            assert_calls(path, name, callee.split(".")[-1])
        made = CALL.findall(collective)
        wrappers = [c for c in made if c.startswith(("dist.", "fsdp."))]  # minigdpo's own, around torch's
        others = [c for c in made if c not in wrappers]
        assert made, f"the row names no call: {collective}"
        for call in wrappers or others:  # the chain's last function makes the outer call
            assert_calls(*chain[-1], call)
        for wrapper in wrappers:  # and the wrapper the torch call, or the torch.distributed function named first
            inner = others or [re.match(r"`(\w+)`", collective).group(1)]
            twice = not others and re.match(r"`\w+`, twice", collective)
            for call in inner:
                module, function = wrapper.split(".", 1)
                assert_calls(f"{module}.py", function, call, 2 if twice else None)
        checked += 1
    assert checked >= 30
