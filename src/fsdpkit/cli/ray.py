"""`fsdpkit ray create|status|delete|submit|exec`: a KubeRay RayCluster from a job spec, and work on it."""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
from typing import TYPE_CHECKING, Any

from fsdpkit import yamlfile
from fsdpkit.cli.output import (
    Parser,
    add_namespace,
    add_spec_namespace,
    context_namespace,
    delete_asked,
    dispatch,
    emit_json,
)
from fsdpkit.effects import Effect, declare
from fsdpkit.envelope import duration
from fsdpkit.errors import NotFound, UserError

if TYPE_CHECKING:  # imported when a verb runs, so that --help stays fast
    from fsdpkit.jobs.ray import RayClient
    from fsdpkit.jobs.resolved import ResolvedJob

log = logging.getLogger(__name__)


def _client(args: argparse.Namespace) -> tuple[RayClient, Any]:
    from fsdpkit.cluster.client import connect
    from fsdpkit.jobs.ray import RayClient

    api = connect(args.context, args.kubeconfig)
    return RayClient(api), api


def _job(args: argparse.Namespace) -> ResolvedJob:
    from fsdpkit.image.dockerfile import has_ofi_nccl
    from fsdpkit.jobs.resolved import load_job
    from fsdpkit.jobs.spec import parse_overrides
    from fsdpkit.yamlfile import load_mapping

    # Any backend validates as a cluster spec here (a RayCluster always needs an image); a HyperPod
    # spec keeps its backend, so its pods get HyperPod's node-health rules.
    overrides = parse_overrides(args.set or [])
    if args.cluster_name:
        overrides.append(("name", args.cluster_name))
    backend = dict(overrides).get("backend", load_mapping(args.spec, "job spec", "fields").get("backend"))
    if args.namespace:
        overrides.append(("namespace", args.namespace))
    job = load_job(args.spec, [*overrides, ("backend", "hyperpod" if backend == "hyperpod" else "pytorchjob")],
                   namespace=context_namespace(args))
    spec = job.spec
    if spec.nodes.max > 1 and spec.efa and has_ofi_nccl(spec.image) is False:
        print(f"warning: {spec.image} has no aws-ofi-nccl, so NCCL between the {spec.nodes} nodes runs on TCP "
              "sockets, not EFA; build an image with it: fsdpkit image init --base verl-0.5", file=sys.stderr)
    return job


def cmd_create(args: argparse.Namespace) -> int:
    from fsdpkit.jobs.ray import raycluster_manifest

    job = _job(args)
    if args.dry_run == "server":
        ray, _ = _client(args)
        accepted = ray.server_dry_run(job)
        if args.json:
            return emit_json({"dry_run": "server", "accepted": accepted, "manifest": raycluster_manifest(job)})
        print(f"dry run: the API server accepted {', '.join(accepted)}")
        return 0
    if args.dry_run:
        manifest = raycluster_manifest(job)
        if args.json:
            return emit_json({"manifest": manifest})
        print(yamlfile.dump(manifest), end="")
        return 0
    ray, _ = _client(args)
    out = ray.create(job, wait=args.timeout, poll=args.poll)
    if args.json:
        return emit_json(out)
    print(f"RayCluster {out['name']} {out['action']} ({out['state']})")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    ray, _ = _client(args)
    state = ray.state(args.name, args.namespace)
    if args.json:
        return emit_json({"name": args.name, "namespace": args.namespace, "state": state})
    print(f"{args.name}: {state}")
    return 0


def cmd_delete(args: argparse.Namespace) -> int:
    ray, _ = _client(args)
    targets = ray.delete(args.name, args.namespace, dry_run=True)
    return delete_asked(args, targets, lambda: ray.delete(args.name, args.namespace),
                        f"delete {', '.join(targets)} in {args.namespace}?")


def cmd_submit(args: argparse.Namespace) -> int:
    from fsdpkit.jobs.ray import check_verl_gpus, rayjob_manifest

    if not args.rest:
        raise UserError("give the entrypoint after --, for example: fsdpkit ray submit SPEC -- python train.py")
    spec = _job(args).spec
    job_name = args.job_name or f"{spec.name}-job"
    if args.dry_run:  # what would be created, from the spec alone: no cluster asked
        # The workers `ray create` makes of this spec stand for the cluster's.
        if fewer := check_verl_gpus(shlex.join(args.rest), spec.name, [(spec.nodes.min, spec.gpus)]):
            log.warning(fewer)
        manifest = rayjob_manifest(spec, shlex.join(args.rest), job_name, args.entrypoint_gpus)
        if args.json:
            return emit_json({"dry_run": True, "manifest": manifest})
        print(yamlfile.dump(manifest), end="")
        return 0
    ray, _ = _client(args)
    out = ray.submit(spec, shlex.join(args.rest), job_name, args.entrypoint_gpus)
    if args.json:
        return emit_json(out)
    print(f"submitted RayJob {out['name']} on RayCluster {out['cluster']}")
    return 0


def cmd_exec(args: argparse.Namespace) -> int:
    """Run a command on the head pod (the path VERL GRPO runs take), streaming its output."""
    from kubernetes import client
    from kubernetes.stream import stream

    from fsdpkit.cluster.client import api_errors

    if not args.rest:
        raise UserError("give the command after --, for example: fsdpkit ray exec NAME -- ray status")
    ray, api = _client(args)
    if ray.get(args.name, args.namespace) is None:
        raise NotFound(f"RayCluster {args.name!r} not found in namespace {args.namespace}; create it with "
                       "`fsdpkit ray create SPEC`, or see `kubectl get rayclusters -A`")
    core = client.CoreV1Api(api)
    with api_errors(f"listing the head pod of RayCluster {args.name}", ray.host):
        pods = core.list_namespaced_pod(args.namespace,
                                        label_selector=f"ray.io/cluster={args.name},ray.io/node-type=head")
    heads = [p for p in pods.items if (p.metadata.labels or {}).get("ray.io/node-type") == "head"
             and (p.metadata.labels or {}).get("ray.io/cluster") == args.name]
    if not heads:
        raise UserError(f"RayCluster {args.name!r} has no head pod yet (fsdpkit ray status {args.name})")
    resp = stream(core.connect_get_namespaced_pod_exec, heads[0].metadata.name, args.namespace,
                  container="ray-head", command=args.rest, stdout=True, stderr=True, stdin=False, tty=False,
                  _preload_content=False)
    while resp.is_open():
        resp.update(timeout=1)
        if resp.peek_stdout():
            print(resp.read_stdout(), end="", flush=True)
        if resp.peek_stderr():
            print(resp.read_stderr(), end="", file=sys.stderr, flush=True)
    resp.close()
    return resp.returncode or 0


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="fsdpkit ray", description="KubeRay clusters from a job spec.")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="VERB", parser_class=Parser)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--context")
        p.add_argument("--kubeconfig")
        p.add_argument("--json", action="store_true")

    def spec_args(p: Parser) -> None:
        p.add_argument("spec", help="job spec YAML (image, nodes, instance_type, storage, ...)")
        p.add_argument("--name", dest="cluster_name", help="the RayCluster's name (default: the spec's name)")
        add_spec_namespace(p, "the RayCluster's")
        p.add_spec_overrides()

    p = sub.add_parser("create", help="create the RayCluster, or reuse it if it exists with the same spec")
    spec_args(p)
    p.add_argument("--timeout", type=duration, help="how long to wait for the head to be ready: seconds, or 10m "
                   "(default: do not wait)")
    p.add_argument("--poll", type=duration, default=5.0, help=argparse.SUPPRESS)
    p.add_argument("--dry-run", nargs="?", const="client", choices=("client", "server"),
                   help="print the RayCluster manifest; --dry-run=server has the API server check it and a pod of "
                   "each group (schema, admission) without storing anything")
    common(p)
    p.set_defaults(func=cmd_create)
    declare(p, Effect.REMOTE | Effect.CREATES | Effect.COSTS | Effect.LONG)
    for verb, func, text in (("status", cmd_status, "the cluster's state"),
                             ("delete", cmd_delete, "delete the RayJobs `ray submit` made on it, then the RayCluster "
                              "(asks first)")):
        p = sub.add_parser(verb, help=text)
        p.add_argument("name")
        add_namespace(p, "the RayCluster's")
        if verb == "delete":
            p.add_argument("--dry-run", action="store_true", help="print what would be deleted")
            p.add_argument("--yes", action="store_true", help="do not ask for confirmation")
        common(p)
        p.set_defaults(func=func)
        declare(p, Effect.REMOTE | (Effect.DELETES if verb == "delete" else Effect.NONE))
    p = sub.add_parser("submit", help="a RayJob on the cluster: fsdpkit ray submit SPEC -- ENTRYPOINT")
    spec_args(p)
    p.add_argument("--job-name")
    p.add_argument("--entrypoint-gpus", type=float, default=0, help="GPUs for the driver (entrypointNumGpus)")
    p.add_argument("--dry-run", action="store_true", help="print the RayJob; nothing is sent to a cluster")
    common(p)
    p.set_defaults(func=cmd_submit)
    declare(p, Effect.REMOTE | Effect.CREATES | Effect.LONG)
    p = sub.add_parser("exec", help="run a command on the head pod: fsdpkit ray exec NAME -- CMD")
    p.add_argument("name")
    add_namespace(p, "the RayCluster's")
    common(p)
    p.set_defaults(func=cmd_exec)
    declare(p, Effect.REMOTE | Effect.CREATES | Effect.LONG)   # any command, on the cluster
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after `--` is the entrypoint or command, untouched by our own flags.
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = build_parser()
    parser.set_defaults(rest=rest)
    return dispatch(parser, argv)
