"""Mutation testing (`make mutation`, not part of `make test`): how many one-token changes to the
modules that derive a job's numbers or decide training's correctness the tests catch.

    python -m benchmarks.mutation [--work DIR] [--children N] [--threshold 85] [--no-results-md]

mutmut (its [tool.mutmut] section in pyproject.toml names the modules and the tests) runs in a copy
of the tree, so the checkout is never left mutated; the score per module (killed over all mutants,
a mutant no test reaches counted as surviving) goes to RESULTS.md, the survivors to a file in the
work folder. Exits 1 when a module scores under the threshold.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

from benchmarks.common import append_rows, environment

ROOT = Path(__file__).resolve().parent.parent
# mutmut's name for a mutant: the module, then `x_` (a function) or `xǁClassǁ` (a method).
MUTANT = re.compile(r"^\s*(?P<name>(?P<module>[\w.]+?)\.x[_ǁ]\S*): (?P<status>.+)$")
CAUGHT = ("killed", "timeout", "caught by type check")


def copy_tree(dest: Path) -> None:
    """The files git would commit (tracked, and new ones not ignored), and ../shared beside them
    as the tests find it (ROOT.parent / "shared" of the copy's mutants/ folder)."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                            capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = ROOT / rel
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():  # examples/jobs is a link into the package
            (dest / rel).symlink_to(os.readlink(src))
        elif src.is_file():
            shutil.copy2(src, dest / rel)
    if (shared := ROOT.parent / "shared").is_dir():
        (dest / "shared").symlink_to(shared)


def parse(results: str) -> dict[str, Counter]:
    """Per module, how many mutants ended how (mutmut's `results --all true`)."""
    by_module: dict[str, Counter] = defaultdict(Counter)
    for line in results.splitlines():
        if m := MUTANT.match(line):
            by_module[m["module"]][m["status"]] += 1
    return dict(by_module)


def survivors(results: str) -> list[str]:
    return [m["name"] for line in results.splitlines() if (m := MUTANT.match(line)) and m["status"] not in CAUGHT]


def caught(counts: Counter) -> int:
    return sum(counts[s] for s in CAUGHT)


def score(counts: Counter) -> float:
    return 100 * caught(counts) / max(1, sum(counts.values()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, help="folder for the copy and mutmut's state (default: a new one)")
    parser.add_argument("--children", type=int, default=os.cpu_count() or 1, help="mutants tested at once")
    parser.add_argument("--threshold", type=float, default=85.0, help="the score every module must reach (%%)")
    parser.add_argument("--no-results-md", action="store_true", help="print the scores only")
    args = parser.parse_args(argv)

    work = args.work or Path(tempfile.mkdtemp(prefix="fsdpkit-mutation-"))
    tree = work / "tree"
    if tree.exists():
        shutil.rmtree(tree)
    tree.mkdir(parents=True)
    copy_tree(tree)
    # The mutated tree first, also for the processes a test starts (a CLI in a subprocess would
    # otherwise import the checkout's fsdpkit through the editable install, which may have moved on).
    # The folder exists before Python starts: a path entry missing at start-up is cached as having
    # nothing to import, and the checkout's fsdpkit would be tested instead of the mutants.
    (tree / "mutants" / "src").mkdir(parents=True)
    # One thread per math library: mutmut forks a child per mutant from a process that has run
    # torch, and a child forked while OpenMP's worker threads held a lock waits on it forever (seen:
    # plan/memory's mutants, every child asleep on a futex).
    env = {**os.environ, "PYTHONPATH": str(tree / "mutants" / "src"), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    log = work / "mutmut.log"
    print(f"mutation: mutmut in {tree} (its progress in {log}); this takes a while", flush=True)
    with log.open("w") as out:
        run = subprocess.run([sys.executable, "-m", "mutmut", "run", "--max-children", str(args.children)],
                             cwd=tree, env=env, stdout=out, stderr=subprocess.STDOUT, check=False)
    if run.returncode != 0:
        print(f"mutation: mutmut failed ({run.returncode}); the end of {log}:\n{log.read_text()[-3000:]}")
        return 2
    results = subprocess.run([sys.executable, "-m", "mutmut", "results", "--all", "true"], cwd=tree, env=env,
                             capture_output=True, text=True, check=True).stdout
    by_module = parse(results)
    (work / "survivors.txt").write_text("\n".join(survivors(results)) + "\n")
    rows, low = [], []
    for module, counts in sorted(by_module.items()):
        total, killed, pct = sum(counts.values()), caught(counts), score(counts)
        rows.append([module, total, killed, counts["survived"], counts["no tests"], f"{pct:.1f}%"])
        print(f"{module:45} {total:5} mutants, {killed:5} killed, {counts['survived']:5} survived, "
              f"{counts['no tests']:5} reached by no test: {pct:.1f}%")
        if pct < args.threshold:
            low.append(module)
    print(f"mutation: survivors listed in {work / 'survivors.txt'} (`mutmut show NAME` in {tree})")
    if not args.no_results_md:
        env_info = environment()
        append_rows("Mutation testing (`make mutation`)",
                    ["date", "commit", "module", "mutants", "killed", "survived", "reached by no test", "score"],
                    [[env_info["date"], env_info["commit"], *r] for r in rows])
    if low:
        print(f"mutation: under {args.threshold:.0f}%: {', '.join(low)}")
    return 1 if low else 0


if __name__ == "__main__":
    raise SystemExit(main())
