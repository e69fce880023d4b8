"""Resource bombs: how long and how much memory `fsdpkit job render` takes to refuse them.

    python -m benchmarks.bad_input            # a YAML alias bomb and a 50 MB spec; appends to RESULTS.md
    python -m benchmarks.bad_input --smoke    # the bomb and a 6 MB spec (CI)

Before YAML went through one loader, the alias bomb (a few hundred bytes whose nine levels of
nine aliases expand to 387 million nodes, inside a spec's `affinity`) grew past 4 GB and was
killed after 90 s, and a 50 MB spec took 80 s and 1.5 GB to be accepted. The target: each refused
(exit 2, one line) in under 2 s with the peak resident memory of a command that reads nothing big.
Each case is a fresh `fsdpkit` process; its wall time and peak resident set come from wait4.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import append_rows, arguments, environment, write_json

TARGET_S = 2.0


def alias_bomb() -> str:
    levels = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]\n" for i in range(9))
    return "name: bomb\nbackend: pytorchjob\nimage: x:1\naffinity:\n" + "".join(f"  {x}\n" for x in levels.splitlines())


def huge_spec(megabytes: int) -> str:
    lines = ["name: huge", "backend: pytorchjob", "image: x:1", "labels:"]
    i, size = 0, 0
    while size < megabytes * 2**20:
        line = f"  key-{i:09d}: value-{i:09d}"
        lines.append(line)
        size += len(line) + 1
        i += 1
    return "\n".join(lines) + "\n"


def measure(spec: Path) -> dict:
    """One `fsdpkit job render SPEC` in its own process: exit code, first stderr line, seconds, peak MiB."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "fsdpkit", "job", "render", str(spec)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    err = proc.stderr.read() if proc.stderr else ""
    return {"exit_code": os.waitstatus_to_exitcode(status), "stderr_lines": len(err.strip().splitlines()),
            "line": err.strip().splitlines()[0] if err.strip() else "", "seconds": seconds,
            "peak_mib": usage.ru_maxrss / 1024, "bytes": spec.stat().st_size}


def main(argv: list[str] | None = None) -> int:
    parser = arguments(__doc__, "bad_input.json", "a 6 MB spec instead of 50 MB (CI)")
    args = parser.parse_args(argv)
    size = 6 if args.smoke else 50
    rows = []
    with tempfile.TemporaryDirectory() as d:
        baseline = Path(d) / "ok.yaml"
        baseline.write_text("name: ok\nbackend: pytorchjob\nimage: x:1\n")
        cases = {"alias bomb in affinity": alias_bomb(), f"{size} MB spec": huge_spec(size)}
        ok = measure(baseline)
        print(f"a small valid spec: {ok['seconds']:.2f} s, {ok['peak_mib']:.0f} MiB peak (exit {ok['exit_code']})")
        for name, text in cases.items():
            path = Path(d) / "spec.yaml"
            path.write_text(text)
            row = {"case": name, **measure(path), "baseline_peak_mib": ok["peak_mib"]}
            row["meets_target"] = (row["exit_code"] == 2 and row["stderr_lines"] == 1 and row["seconds"] < TARGET_S
                                   and row["peak_mib"] < ok["peak_mib"] + 64)
            print(f"{name}: exit {row['exit_code']} in {row['seconds']:.2f} s, {row['peak_mib']:.0f} MiB peak: "
                  f"{row['line'][:120]}")
            rows.append(row)
    write_json(args.out, {"env": environment(), "smoke": args.smoke, "rows": rows})
    if not args.smoke and not args.no_results_md:
        env = environment()
        append_rows("Resource bombs: fsdpkit job render refusing them",
                    ["date", "device", "commit", "case", "bytes", "exit", "seconds", "peak MiB",
                     "small spec's peak MiB", "target met (exit 2, one line, < 2 s, < small + 64 MiB)"],
                    [[env["date"], env["device"], env["commit"], r["case"], f"{r['bytes']:,}", r["exit_code"],
                      f"{r['seconds']:.2f}", f"{r['peak_mib']:.0f}", f"{r['baseline_peak_mib']:.0f}",
                      "yes" if r["meets_target"] else "NO"] for r in rows])
    return 0 if all(r["meets_target"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
