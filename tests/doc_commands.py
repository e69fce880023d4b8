"""The `fsdpkit ...` command lines of a Markdown document's code blocks, as a reader copies them:
continuation lines joined, a `$ ` or `.venv/bin/` prefix dropped. Shared by the docs and skills tests."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

FENCE = re.compile(r"```[a-z]*\n(.*?)```", re.S)


def command_lines(path: Path) -> list[str]:
    found = []
    for block in FENCE.findall(path.read_text()):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"^\s*(\$\s*)?(\.venv/bin/)?", "", line)
            if line.startswith("fsdpkit "):
                found.append(line)
    return found


def argv(line: str) -> list[str]:
    """A documented command line as a shell runs it: argv up to a pipe or `&&`, an entrypoint after
    `--` included."""
    words = shlex.split(line, comments=True)
    ends = [words.index(t) for t in ("|", "&&") if t in words]
    return words[:min(ends)] if ends else words


# The sequence length a walk trains at where a documented training line names none of its own (nor
# a config that may): what the line shows (it finds its files, parses, trains and saves) holds at
# any length, and a preset's own (up to 2048 tokens) costs a CPU step several times as much.
WALK_SEQ_LEN = "128"


def short_sequences(train_argv: list[str]) -> list[str]:
    """A `train` line's arguments at WALK_SEQ_LEN tokens where it leaves the length to its preset."""
    named = {a.split("=")[0].replace("_", "-") for a in train_argv}
    return train_argv if named & {"--seq-len", "--config"} else [*train_argv, "--seq-len", WALK_SEQ_LEN]


def tokens(line: str) -> list[str]:
    """A documented command line as argv, up to a pipe or `&&`, and up to a bare `--` (what follows
    is the entrypoint's own command line)."""
    argv = shlex.split(line, comments=True)
    ends = [argv.index(t) for t in ("|", "&&", "--") if t in argv]
    return argv[:min(ends)] if ends else argv
