"""What a command does to the world, declared beside its parser: the one source of an agent tool's
consent rule and hints (fsdpkit.cli.tools), so a new command states it once and is refused nothing
it should be, and granted nothing it should not.

A declaration is what the command always does, and what it does only when an argument is set
(`image check` rewrites files only with --fix). A dry run (`dry_run` set) creates, deletes, costs
and overwrites nothing, whatever else is set.
"""

from __future__ import annotations

import argparse
import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class Effect(enum.Flag):
    NONE = 0
    REMOTE = enum.auto()      # talks to AWS, a cluster, a registry or a hub (reading counts)
    WRITES = enum.auto()      # writes new local files
    OVERWRITES = enum.auto()  # replaces local files that exist
    CREATES = enum.auto()     # creates or changes cloud or cluster resources
    DELETES = enum.auto()     # deletes or replaces what exists on a cloud or cluster
    COSTS = enum.auto()       # starts what AWS bills: nodes, file systems, builds, jobs on GPUs
    LONG = enum.auto()        # runs for minutes or longer: its progress is worth following


# What a caller must agree to first (a human at the CLI's prompt, an agent's user through `yes`).
CONSENT = Effect.OVERWRITES | Effect.CREATES | Effect.DELETES | Effect.COSTS
# Consent's effects in words, in the order a refusal names them.
WORDS = ((Effect.DELETES, "deletes what it names"), (Effect.CREATES, "creates or changes cloud or cluster resources"),
         (Effect.COSTS, "starts what AWS bills"), (Effect.OVERWRITES, "overwrites local files"))
KEY = "_fsdpkit_effects"   # the parser default that carries a command's declaration


@dataclass(frozen=True)
class Effects:
    always: Effect
    when: tuple[tuple[str, Effect], ...] = ()   # (argument, what it adds when set)

    def of(self, arguments: Mapping[str, Any]) -> Effect:
        """What a call with these arguments does."""
        effect = self.always
        for name, extra in self.when:
            if arguments.get(name) not in (None, False, [], ""):
                effect |= extra
        return effect & ~CONSENT if arguments.get("dry_run") else effect

    @property
    def possible(self) -> Effect:
        """Everything some call of the command does: every argument that adds something set."""
        return self.of({name: True for name, _ in self.when})


def declare(parser: argparse.ArgumentParser, always: Effect, **when: Effect) -> None:
    """State what the command of `parser` does (`when`: by argument name, as a tool names it)."""
    parser.set_defaults(**{KEY: Effects(always, tuple(when.items()))})


def declared(parser: argparse.ArgumentParser) -> Effects | None:
    found = parser.get_default(KEY)
    return found if isinstance(found, Effects) else None


def in_words(effect: Effect) -> str:
    return ", ".join(words for flag, words in WORDS if flag & effect)
