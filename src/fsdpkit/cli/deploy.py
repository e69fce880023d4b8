"""`fsdpkit deploy SPEC`: check the cluster, ensure storage and secret, submit, watch to the end."""

from __future__ import annotations

import argparse
import sys

from fsdpkit.cli.output import Parser, add_spec_namespace, context_namespace, dispatch, emit_json, progress
from fsdpkit.effects import Effect, declare
from fsdpkit.envelope import duration


def cmd_deploy(args: argparse.Namespace) -> int:
    from fsdpkit.jobs.backends import Target, get_backend
    from fsdpkit.jobs.deploy import deploy
    from fsdpkit.jobs.resolved import load_job
    from fsdpkit.jobs.spec import parse_overrides

    overrides = parse_overrides(args.set or []) + ([("namespace", args.namespace)] if args.namespace else [])
    job = load_job(args.spec, overrides, pin_image=True, namespace=context_namespace(args))
    spec = job.spec
    backend = get_backend(spec.backend, Target(args.context, args.kubeconfig, spec.namespace))
    say = progress(args)
    skip = {s.strip() for s in (args.skip or "").split(",") if s.strip()}
    out = deploy(job, backend, skip, say, poll=args.poll, fresh=args.fresh, strict=args.strict)
    if args.json:
        return emit_json(out)
    print(f"deployed {spec.name}: " + ", ".join(f"{k} {v if isinstance(v, str) else 'ok'}"
                                                 for k, v in out["steps"].items()))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="fsdpkit deploy", description="One command: check the cluster -> storage -> secret -> "
               "submit -> watch. After a failure, run it again to continue from the failed step.")
    p.add_argument("spec", help="job spec YAML (trainjob, pytorchjob or hyperpod backend)")
    p.add_spec_overrides()
    add_spec_namespace(p, "the job's")
    p.add_argument("--skip", help="comma-separated steps to skip: check,storage,secret,submit,watch")
    p.add_argument("--fresh", action="store_true", help="ignore the progress of an earlier failed deploy")
    p.add_argument("--strict", action="store_true", help="stop at the check step when the capacity planner says "
                   "the job cannot fit (otherwise a warning)")
    p.add_argument("--poll", type=duration, default=15.0,
                   help="time between looks while watching (seconds, or 30s, 1m)")
    p.add_argument("--context")
    p.add_argument("--kubeconfig")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_deploy)
    declare(p, Effect.REMOTE | Effect.CREATES | Effect.COSTS | Effect.LONG)
    return p


def main(argv: list[str] | None = None) -> int:
    return dispatch(build_parser(), list(sys.argv[1:] if argv is None else argv))
