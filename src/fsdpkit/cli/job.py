"""`fsdpkit job render|submit|status|logs|list|delete|wait`: one JobSpec, any backend."""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from pathlib import Path
from typing import Any

from fsdpkit.cli.job_text import (
    ended,
    network_text,
    pods_text,
    print_jobs,
    print_snapshot,
    print_sources,
    print_status,
    print_submitted,
    print_unreachable,
    read_why,
)
from fsdpkit.cli.output import (
    Parser,
    add_namespace,
    add_spec_namespace,
    context_namespace,
    delete_asked,
    dispatch,
    emit_json,
    finding_message,
    write_new,
)
from fsdpkit.effects import Effect, declare
from fsdpkit.envelope import duration, said_once_accepted
from fsdpkit.errors import UserError
from fsdpkit.extras import missing_extra
from fsdpkit.home import jobs_home
from fsdpkit.jobs.backends import Backend, Target, Watchable, get_backend, wait
from fsdpkit.jobs.backends.base import Listing, Submitted
from fsdpkit.jobs.capacity import capacity as check_capacity
from fsdpkit.jobs.hub import check_hub_access
from fsdpkit.jobs.resolved import ResolvedJob, load_job
from fsdpkit.jobs.spec import BACKENDS, CLUSTER_BACKENDS, JobSpec, parse_overrides
from fsdpkit.jobs.status import JobStatus
from fsdpkit.jobs.utilisation import WatchHistory
from fsdpkit.readers import reading

log = logging.getLogger(__name__)

# Direct flags for the fields people change most; anything else goes through --set KEY=VALUE.
_SHORTCUTS = ("name", "image", "backend", "namespace", "nodes", "instance_type")


def _job(args: argparse.Namespace) -> ResolvedJob:
    overrides = parse_overrides(args.set or [])
    overrides += [(k, getattr(args, k)) for k in _SHORTCUTS if getattr(args, k, None) is not None]
    return load_job(args.spec, overrides, pin_image=True, namespace=context_namespace(args))


def _backend(args: argparse.Namespace, spec: JobSpec | None = None) -> Backend:
    name = spec.backend if spec is not None else args.backend
    if name is None:  # a NAME verb without --backend: a local job of that name, else the cluster
        name = "local" if (jobs_home() / args.job).is_dir() else "pytorchjob"
    return get_backend(name, _target(args, spec))


def _target(args: argparse.Namespace, spec: JobSpec | None = None) -> Target:
    """Where the verb acts: --context and --kubeconfig, in the spec's namespace or -n's (resolved:
    the kubeconfig context's where -n is not given)."""
    namespace = spec.namespace if spec is not None else getattr(args, "namespace", None) or "default"
    return Target(getattr(args, "context", None), getattr(args, "kubeconfig", None), namespace)


def cmd_init(args: argparse.Namespace) -> int:
    from fsdpkit.jobs.starter import starter

    name = args.name or (args.preset.replace("_", "-") if args.preset else "my-job")
    text = starter(args.backend, name, args.instance_type, args.nodes, args.image, args.preset, args.storage_claim,
                   args.shared_path, args.dataset, args.tokenizer, args.init_from_hf, args.data_format, args.lora,
                   args.dataset_config_name, args.objective, args.base_dtype, args.team, args.priority)
    if args.out == "-":
        if args.json:   # the spec goes in the envelope: stdout stays one JSON document
            return emit_json({"path": None, "text": text, "backend": args.backend, "name": name})
        print(text, end="")
        return 0
    out = Path(args.out)
    write_new(out, text, args.force)
    if args.json:
        return emit_json({"path": str(out), "backend": args.backend, "name": name})
    first = "set image: in it (fsdpkit image push prints it), then " if args.backend in CLUSTER_BACKENDS and \
        not args.image else ""
    print(f"wrote {out}; next: {first}fsdpkit job render {out}, fsdpkit plan {out}, fsdpkit job submit {out} "
          "--dry-run")
    return 0


def cmd_render(args: argparse.Namespace) -> int:
    job = _job(args)
    spec = job.spec
    if args.explain:   # what the job derives, which needs no image yet
        if args.json:
            return emit_json({"name": spec.name, "backend": spec.backend,
                              "explain": [s.to_dict() for s in job.sources]})
        print_sources(job)
        return 0
    rendered = get_backend(spec.backend).render(job)
    # What submit would warn of (a job that cannot fit its GPUs or keep its checkpoints), said before
    # the manifests are applied by hand.
    capacity = check_capacity(job, False, log.warning)
    if why := job.default_steps():
        log.warning(why)
    if args.json:
        return emit_json({"name": spec.name, "backend": spec.backend, **rendered.as_json(), "capacity": capacity})
    print(rendered.text(), end="")
    if rendered.needs:
        log.info(f"note: these manifests need {rendered.needs}")
    if rendered.pod_security:  # on stderr: stdout stays YAML for kubectl
        log.info(f'note: these pods meet Pod Security "{rendered.pod_security}"'
                 + ('; a namespace that enforces "restricted" refuses them: set security: restricted there'
                    if rendered.pod_security == "baseline" else f" (they run as user {spec.run_as_user}, not root)"))
    return 0


def _submitted(args: argparse.Namespace) -> tuple[ResolvedJob, Backend, dict[str, Any] | None, Submitted]:
    """The job resolved, checked and handed to its backend. A refused submit prints its error alone:
    the notes resolving the spec made (a resumed checkpoint's vocabulary) are said once the backend
    takes the job, at once for a local or Slurm one; a cluster's submit says them before it starts,
    so that its waits are said as they come."""
    with contextlib.ExitStack() as held:
        held.enter_context(said_once_accepted())
        job = _job(args)
        check_hub_access(job.spec)
        backend = _backend(args, job.spec)
        capacity = check_capacity(job, args.strict, log.warning)
        if job.spec.backend in CLUSTER_BACKENDS:
            held.close()
        return job, backend, capacity, backend.submit(job, replace=args.replace, dry_run=args.dry_run)


def cmd_submit(args: argparse.Namespace) -> int:
    if args.output and not args.dry_run:
        raise UserError("-o yaml prints what a dry run would create; add --dry-run")
    job, backend, capacity, result = _submitted(args)
    spec = job.spec
    if why := job.default_steps():   # once it is submitted (or would be): a failed submit stays one line
        log.warning(why)
    out = result.to_dict() | ({"plan": capacity} if capacity is not None else {})
    final = None
    if args.wait and not args.dry_run:
        final = wait(backend, spec.name, poll=args.poll, on_change=None if args.json else print_status)
        out["final"] = final.to_dict()
    if args.json:
        if final is not None and final.state != "Succeeded":
            return emit_json(out, 1, ended(out["final"]), hint=read_why(spec.name))
        return emit_json(out)
    if args.dry_run and args.output == "yaml":
        print(backend.render(job).text(), end="")
        return 0
    print_submitted(job, result)
    if final is not None:
        return 0 if final.state == "Succeeded" else 1
    if not args.dry_run:
        print(f"follow it with: fsdpkit job logs {spec.name} -f")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    backend = _backend(args)
    if isinstance(backend, Watchable):
        st = backend.describe(args.job)
    else:
        st = backend.status(args.job)
        network = backend.network(args.job)
        st.details["network"] = network.to_dict() if network else None
    if args.json:
        return emit_json(st.to_dict())
    print_status(st)
    if st.details.get("pods"):
        print(f"  pods: {pods_text(st.details['pods'])}")
    if st.details["network"]:
        print(f"  network: {network_text(st.details['network'])}")
    print_unreachable(st.details.get("unreachable") or [])
    if "network" in (st.details.get("gaps") or {}):
        log.warning(f"network not read: {st.details['gaps']['network']}")
    return 0


def _jobs_of(name: str, args: argparse.Namespace) -> Listing | None:
    """One backend's jobs for `job list`; None, with a note, where it has none to ask (no kubeconfig,
    or an install without the cluster extra). Its failure is raised: the answer where the backend
    was asked for (--backend), else kept while the other backends' jobs are shown."""
    from fsdpkit.cluster.client import ClusterError

    try:
        return get_backend(name, _target(args)).jobs()
    except ModuleNotFoundError as e:   # a training-only install: its local jobs are still listed
        if args.backend or (err := missing_extra(e, "cluster jobs")) is None:
            raise
        log.info(f"note: cluster jobs not listed: {err}")
    except ClusterError as e:
        if args.backend or e.code != "no_credentials":
            raise
        log.info(f"note: cluster jobs not listed: {e}")
    return None


def cmd_list(args: argparse.Namespace) -> int:
    """Every job that could be read; what could not be read is named, and a cluster that could not
    be read at all (down, or every job kind refused) is exit 3, with the jobs read elsewhere still
    shown. No kubeconfig at all is no cluster to ask: a note."""
    from fsdpkit.cluster.client import ClusterError

    # One Kubernetes backend lists every kind it knows (TrainJob, PyTorchJob, HyperPodPyTorchJob).
    backends = [args.backend] if args.backend else ["local", "pytorchjob"]
    rows: list[JobStatus] = []
    unread: dict[str, str] = {}
    failed: ClusterError | None = None
    for name in backends:
        try:
            listing = _jobs_of(name, args)
        except ClusterError as e:
            failed = e
            continue
        if listing is None:
            continue
        rows += listing.jobs
        unread.update(listing.unread)
    rows = [r for r in rows if args.backend in (None, r.backend)]
    data = {"jobs": [r.to_dict() for r in rows], "unread": unread}
    if args.json:
        if failed is not None:
            return emit_json(data, failed.exit_code, str(failed), failed.code, hint=failed.hint)
        return emit_json(data)
    print_jobs(rows, unread, listed=failed is None)
    if failed is not None:
        print(f"error: {failed}", file=sys.stderr)
        return failed.exit_code
    return 0


def cmd_delete(args: argparse.Namespace) -> int:
    backend = _backend(args)
    targets = backend.cancel(args.job, delete_storage=args.delete_storage, dry_run=True)
    # The checkpoints on a volume fsdpkit created go with it: only that is asked first.
    code = delete_asked(args, targets, lambda: backend.cancel(args.job, args.delete_storage),
                        f"delete {', '.join(targets)}, checkpoints included?", ask=args.delete_storage)
    if code == 0 and not (args.json or args.dry_run or args.delete_storage):
        print("its checkpoint storage is kept (pass --delete-storage to remove a volume fsdpkit created)")
    return code


def cmd_logs(args: argparse.Namespace) -> int:
    from fsdpkit.jobs.health import check_network_log

    lines = []
    for line in _backend(args).logs(args.job, follow=args.follow, replica=args.replica,
                                    previous=args.previous, wait=args.timeout):
        if args.check_network or args.json:
            lines.append(line)
        if not args.json:
            print(line, flush=True)
    verdict, why = check_network_log("\n".join(lines)) if args.check_network else (None, None)
    if args.json:
        check = verdict and {"verdict": verdict, "why": why}
        return emit_json({"name": args.job, "lines": lines, "network_check": check}, 1 if verdict == "fail" else 0,
                         f"network check failed: {why}",
                         hint="run `fsdpkit cluster validate nccl` to test EFA without the job")
    if verdict:
        log.info(f"network check: {verdict}: {why}")
    return 1 if verdict == "fail" else 0


def cmd_check_network(args: argparse.Namespace) -> int:
    from fsdpkit.jobs.health import check_network_log

    if args.log == "-":
        text = sys.stdin.read()
    else:
        path = Path(args.log)
        if not path.is_file():
            raise UserError(f"check-network: {path} is not a file; pass a saved log (or - for standard input)")
        with reading(path, "check-network"):
            text = path.read_text(errors="replace")
    verdict, why = check_network_log(text)
    if args.json:
        return emit_json({"log": args.log, "verdict": verdict, "why": why}, 1 if verdict == "fail" else 0,
                         f"network check failed: {why}" if verdict == "fail" else "",
                         hint="run `fsdpkit cluster validate nccl` to test EFA without the job")
    print(f"network check: {verdict}: {why}")
    return 1 if verdict == "fail" else 0


def cmd_watch(args: argparse.Namespace) -> int:
    import time

    backend = _backend(args)
    if not isinstance(backend, Watchable):
        raise UserError(f"job watch works on Kubernetes jobs; for {backend.name} use `fsdpkit job logs -f`")
    history = WatchHistory()
    while True:
        snap = backend.snapshot(args.job, stall_after=args.stall_after,
                                sample=0 if args.no_sample else args.sample_seconds, history=history)
        done = args.once or snap.state in ("Succeeded", "Failed")
        code = 0 if snap.state != "Failed" and not (args.once and snap.findings) else 1
        if args.json:
            # Every look is an envelope (one per line under a live watch); the last one's ok is the exit code.
            data = snap.to_dict()
            message, hint = ended(data), read_why(args.job)
            if snap.findings:
                first = snap.findings[0]
                message, hint = finding_message(first), first.get("fix") or hint
            emit_json(data, code if done else 0, message, hint=hint)
        else:
            print_snapshot(snap)
        # The job's own budget (resubmits: in its spec) decides whether it starts again.
        if snap.state == "Failed" and not args.once and args.resubmit and backend.resubmit(args.job):
            continue
        if done:
            return code
        time.sleep(args.poll)


def cmd_wait(args: argparse.Namespace) -> int:
    st = wait(_backend(args), args.job, timeout=args.timeout, poll=args.poll,
              on_change=None if args.json else print_status)
    blocked = st.details.get("blocked")
    code = 0 if st.state == "Succeeded" else 1 if st.finished or blocked else 124
    stuck = f"job {args.job} will not start: {blocked}" if blocked else ""
    if stuck and not args.json:
        print(f"error: {stuck}", file=sys.stderr)
    if args.json:
        timed_out = f"job {args.job} still {st.state} after {args.timeout:g} s" if code == 124 else ""
        hint = "fix what it names in the spec and submit it again (job submit --replace)" if blocked else \
            read_why(args.job) if code == 1 else None
        return emit_json(st.to_dict(), code, stuck or timed_out or ended(st.to_dict()),
                         "timeout" if code == 124 else "failed", hint=hint)
    return code


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="fsdpkit job", description="Describe a training job once; run it locally, on EKS "
                     "(Kubeflow Trainer v2 TrainJob, or the legacy PyTorchJob), on SageMaker HyperPod or on Slurm.")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="VERB", parser_class=Parser)

    def common(p: argparse.ArgumentParser, cluster: bool = True) -> None:
        p.add_argument("--json", action="store_true", help="one JSON envelope on stdout")
        if cluster:
            p.add_argument("--context", help="kubeconfig context (default: the current one)")
            p.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG or ~/.kube/config)")

    def spec_args(p: Parser) -> None:
        p.add_argument("spec", nargs="?", help="job spec YAML (`fsdpkit job init` writes one with every field "
                       "explained); omit to start from the defaults")
        p.add_spec_overrides()
        for k in _SHORTCUTS:
            if k == "namespace":   # -n, as on every other verb that takes a namespace
                add_spec_namespace(p, "override")
            else:
                p.add_argument(f"--{k.replace('_', '-')}", dest=k, help=f"override {k}")

    def name_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("job", metavar="NAME")
        p.add_argument("--backend", choices=BACKENDS, help="default: a local job of that name, else the cluster")
        add_namespace(p)

    p = sub.add_parser("init", help="write a starter job spec: every field with a one-line comment")
    p.add_argument("--backend", choices=BACKENDS, default="local", help="where it runs")
    p.add_argument("--name", help="the job's name (default: from the preset, else my-job)")
    p.add_argument("--instance-type", help="EC2 instance type (HyperPod: ml.p5.48xlarge; p5.48xlarge is renamed)")
    p.add_argument("--nodes", help="N, or MIN:MAX for an elastic job")
    p.add_argument("--image", help="the container image (`fsdpkit image push` prints it)")
    p.add_argument("--preset", help="model preset (`fsdpkit presets`)")
    p.add_argument("--storage-claim", help="an existing PVC for checkpoints (FSx for Lustre), on Kubernetes")
    p.add_argument("--shared-path", help="a directory every node mounts (/fsx), on Slurm")
    p.add_argument("--dataset", help="local files, token shards or a Hugging Face dataset (default: embedded text)")
    p.add_argument("--dataset-config-name", help="the hub dataset's configuration (allenai/c4: en)")
    p.add_argument("--tokenizer", help="a Hugging Face tokenizer (default: the preset's)")
    p.add_argument("--init-from-hf", help="fine-tune these Hugging Face weights: a directory the nodes read (on the "
                   "job's storage); --preset names the same model for the planner")
    p.add_argument("--data-format", choices=("text", "chat", "preference"), help="chat: supervised fine-tuning on "
                   "conversations, loss on the answers (the preset's SFT recipe); preference: prompt/chosen/rejected "
                   "records, for --objective dpo")
    p.add_argument("--lora", action="store_true", help="train LoRA adapters only (needs --init-from-hf)")
    p.add_argument("--base-dtype", choices=("auto", "nf4"), help="with --lora: nf4 stores the frozen base in 4 bits "
                   "(QLoRA; the preset's QLoRA recipe)")
    p.add_argument("--objective", choices=("sft", "dpo"), help="dpo: preference tuning after SFT (the preset's DPO "
                   "recipe; needs --data-format preference)")
    p.add_argument("--team", help="submit as this team of HyperPod task governance: its namespace "
                   "(hyperpod-ns-TEAM) and LocalQueue, under its compute quota")
    p.add_argument("--priority", help="with --team: the Kueue WorkloadPriorityClass the job runs at (the cluster "
                   "policy's; `kubectl get workloadpriorityclasses`)")
    p.add_argument("--out", default="job.yaml", help="where to write it (- for stdout)")
    p.add_argument("--force", action="store_true", help="overwrite an existing file")
    common(p, cluster=False)
    p.set_defaults(func=cmd_init)
    declare(p, Effect.WRITES, force=Effect.OVERWRITES)

    p = sub.add_parser("render", help="print the manifests (or script) a spec becomes, after validating it")
    spec_args(p)
    p.add_argument("--explain", action="store_true", help="instead, each value the job derives (grace period, "
                   "deadlines, hang time, checkpoint interval, steps, tokens) with where it came from")
    common(p, cluster=False)
    p.set_defaults(func=cmd_render)
    declare(p, Effect.NONE)

    p = sub.add_parser("submit", help="create the job (Secret, PVC and job on a cluster; a process locally)")
    spec_args(p)
    p.add_argument("--dry-run", nargs="?", const="client", choices=("client", "server"),
                   help="validate and show what would be created; --dry-run=server also has the API server check "
                   "every object (schema, unknown fields, admission) without storing it")
    p.add_argument("-o", "--output", choices=("yaml",), help="with --dry-run: print the manifests (or script) "
                   "instead of their names")
    p.add_argument("--replace", action="store_true", help="delete a job of the same name first")
    p.add_argument("--strict", action="store_true", help="refuse a job the capacity planner says cannot fit")
    p.add_argument("--wait", action="store_true", help="wait for the job to end; exit code from its result")
    p.add_argument("--poll", type=duration, default=10.0, help=argparse.SUPPRESS)
    common(p)
    p.set_defaults(func=cmd_submit)
    declare(p, Effect.REMOTE | Effect.CREATES | Effect.COSTS | Effect.LONG, replace=Effect.DELETES)

    p = sub.add_parser("status", help="the job's state and replicas")
    name_args(p)
    common(p)
    p.set_defaults(func=cmd_status)
    declare(p, Effect.REMOTE)

    p = sub.add_parser("logs", help="print (or follow) the logs of the job's rank-0 pod or a chosen replica")
    name_args(p)
    p.add_argument("-f", "--follow", action="store_true")
    p.add_argument("--replica", help="worker-1, master-0, ... or all")
    p.add_argument("--previous", action="store_true", help="the previous (crashed) container's logs")
    p.add_argument("--timeout", type=duration, default=600.0, help="how long to wait for the job's pods and their "
                   "containers to start (seconds, or 30s, 10m); exit 124 when it runs out")
    p.add_argument("--check-network", action="store_true",
                   help="after the logs, say whether NCCL used EFA (the trainer's network line, or NCCL's own "
                   "lines with diagnose_network: true)")
    common(p)
    p.set_defaults(func=cmd_logs)
    declare(p, Effect.REMOTE | Effect.LONG)

    p = sub.add_parser("check-network", help="say from a saved log whether NCCL used EFA, as logs --check-network "
                       "does for a running job")
    p.add_argument("log", metavar="LOG", help="a job's log saved to a file (kubectl logs, Slurm's output, a "
                   "HyperPod node's), or - for standard input")
    p.add_argument("--json", action="store_true", help="one JSON envelope on stdout")
    p.set_defaults(func=cmd_check_network)
    declare(p, Effect.NONE)

    p = sub.add_parser("list", help="jobs made by fsdpkit")
    p.add_argument("--backend", choices=BACKENDS)
    add_namespace(p, "the jobs'")
    common(p)
    p.set_defaults(func=cmd_list)
    declare(p, Effect.REMOTE)

    p = sub.add_parser("delete",
                       help="stop and remove a job (its checkpoint storage is kept)")
    name_args(p)
    p.add_argument("--delete-storage", action="store_true", help="also delete the PVC fsdpkit created for it, and "
                   "the checkpoints on it (asks first; a claim the spec named is never deleted)")
    p.add_argument("--dry-run", action="store_true", help="print what would be deleted")
    p.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    common(p)
    p.set_defaults(func=cmd_delete)
    declare(p, Effect.REMOTE | Effect.DELETES)

    p = sub.add_parser("watch", help="live step, loss, tokens/s, pods, each node's GPU and EFA use, and problems: "
                       "stall, OOM, crash loop, pending reason, NCCL timeout, straggler, flat EFA")
    name_args(p)
    p.add_argument("--stall-after", type=duration, default=900,
                   help="time without a new step that counts as a stall (seconds, or 15m, 1h)")
    p.add_argument("--poll", type=duration, default=15.0, help="time between looks (seconds, or 30s, 1m)")
    p.add_argument("--once", action="store_true", help="one look; exit 1 if there is a finding")
    p.add_argument("--sample-seconds", type=duration, default=5.0,
                   help="each look, sample every node's GPU utilisation and EFA traffic over this many seconds "
                   "(one exec of sh in each pod): per-node rates, stragglers, EFA that stays flat")
    p.add_argument("--no-sample", action="store_true", help="read pods and logs only; no exec into the pods")
    p.add_argument("--resubmit", action="store_true",
                   help="resubmit a Failed job within its resubmits budget, as `job wait` does")
    common(p)
    p.set_defaults(func=cmd_watch)
    declare(p, Effect.REMOTE | Effect.LONG)

    p = sub.add_parser("wait", help="wait for the job to end: exit 0 Succeeded, 1 Failed, 124 timed out")
    name_args(p)
    p.add_argument("--timeout", type=duration, help="how long to wait: seconds, or 30m, 2h (default: no limit)")
    p.add_argument("--poll", type=duration, default=10.0, help="time between checks (seconds, or 30s, 1m)")
    common(p)
    p.set_defaults(func=cmd_wait)
    declare(p, Effect.REMOTE | Effect.LONG)
    return parser


def main(argv: list[str] | None = None) -> int:
    return dispatch(build_parser(), list(sys.argv[1:] if argv is None else argv))
