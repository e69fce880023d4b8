"""The source stays in pieces a reader can hold: no function or method in src above a cyclomatic
complexity of 20, as radon counts it (`radon cc src`), so a function that grows past it is taken
apart into named steps when it is written, not found later."""

from __future__ import annotations

from conftest import ROOT, require

LIMIT = 20


def over_limit(source: str, name: str) -> list[str]:
    """`name:line function (complexity)` for each function of `source` above LIMIT."""
    complexity = require("radon.complexity")
    return [f"{name}:{b.lineno} {b.fullname} ({b.complexity})" for b in complexity.cc_visit(source)
            if b.complexity > LIMIT]


def test_the_count_is_radon_s_and_it_catches_one_branch_too_many():
    def with_branches(n: int) -> str:
        return "def f(x):\n" + "".join(f"    if x == {i}:\n        return {i}\n" for i in range(n)) + "    return -1\n"
    assert over_limit(with_branches(LIMIT), "a.py") == ["a.py:1 f (21)"]
    assert over_limit(with_branches(LIMIT - 1), "a.py") == []


def test_no_function_in_src_is_above_complexity_20():
    src = ROOT / "src"
    found = [row for path in sorted(src.rglob("*.py"))
             for row in over_limit(path.read_text(), str(path.relative_to(src)))]
    assert not found, "take these apart into named steps:\n" + "\n".join(found)
