"""The namespace a verb acts in, as kubectl resolves it (fsdpkit.cluster.kubeconfig): -n, else a
spec's `namespace:`, else the kubeconfig context's, else default. Held against a team's user on a
shared cluster: a Role in `team-a` only, its kubeconfig context naming `team-a`; every verb that
talks to the cluster, run without -n, sends every namespaced request to `team-a` (kmock sees the
paths), and with `-n team-b` (the user's Role there) to `team-b`; what the admin verbs would apply (their
dry runs) is in that namespace too."""

from __future__ import annotations

import json
import re
import threading
import time

import pytest
import yaml

from fsdpkit.cli import ckpt as ckpt_cli
from fsdpkit.cli import deploy as deploy_cli
from fsdpkit.cli import job as job_cli
from fsdpkit.cli import metrics as metrics_cli
from fsdpkit.cli import ray as ray_cli
from fsdpkit.cli.main import VERBS
from fsdpkit.cli.reference import subcommands, verb_parser
from fsdpkit.cluster.kubeconfig import context_namespace, namespace
from fsdpkit.errors import UserError

from conftest import cli_here, require
from job_specs import TOKEN, write_spec

EVERYTHING = [{"apiGroups": ["*"], "resources": ["*"], "verbs": ["*"]}]


def kubeconfig(tmp_path, text):
    path = tmp_path / "config"
    path.write_text(text)
    return str(path)


CONFIG = """apiVersion: v1
kind: Config
current-context: a
contexts:
- {name: a, context: {cluster: c, user: u, namespace: team-a}}
- {name: b, context: {cluster: c, user: u, namespace: team-b}}
- {name: plain, context: {cluster: c, user: u}}
"""


def test_the_context_names_the_namespace_and_a_given_one_wins(tmp_path, monkeypatch):
    path = kubeconfig(tmp_path, CONFIG)
    assert context_namespace(None, path) == "team-a"          # the current context's
    assert context_namespace("b", path) == "team-b"           # --context's
    assert context_namespace("plain", path) is None           # a context without one
    assert namespace(None, "plain", path) == "default"
    assert namespace("mine", "b", path) == "mine"             # -n, or the spec's namespace:
    monkeypatch.setenv("KUBECONFIG", path)
    assert namespace(None) == "team-a"
    assert namespace(None, kubeconfig=str(tmp_path / "none")) == "default"   # no kubeconfig: default
    with pytest.raises(UserError, match=r"^kubeconfig: cannot read .*config"):
        context_namespace(None, kubeconfig(tmp_path, "contexts: [unclosed\n"))


def run(monkeypatch, capsys, env, cli, *argv):
    """A verb in this process, as the user of `env`."""
    monkeypatch.setenv("KUBECONFIG", env["KUBECONFIG"])
    monkeypatch.setenv("FSDPKIT_HOME", "/nonexistent-fsdpkit-home")
    monkeypatch.setenv("MY_HF_TOKEN", TOKEN)
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def namespaces(kube, since, dry_since, what):
    """The namespaces of the requests kmock saw from the `since`-th on, and of the server dry runs
    from the `dry_since`-th (access reviews left out: they carry theirs in the body)."""
    paths = [p for _, p, _ in kube.requests(since) if "selfsubjectaccessreviews" not in p]
    paths += [p for p, _ in kube.dry_runs[dry_since:]]
    assert paths, f"{what}: sent no request"
    return {m.group(1) for p in paths if (m := re.search(r"/namespaces/([^/?]+)/", p))}


def kubelet(kube, ns, listing):
    """The helper pod `ckpt list --pvc` starts, run: its log is `listing`, its phase Succeeded."""
    from kubernetes import client

    def play():
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            pods = [b for m, p, b in kube.requests() if m == "POST" and p.split("?")[0].endswith(f"{ns}/pods")
                    and b["metadata"]["name"].startswith("fsdpkit-helper-")]
            if pods:
                name = pods[-1]["metadata"]["name"]
                kube.route(f"get /api/v1/namespaces/{ns}/pods/{name}/log", listing.encode())
                client.CoreV1Api(kube.api()).patch_namespaced_pod_status(name, ns, {"status": {"phase": "Succeeded"}})
                return
            time.sleep(0.05)
    t = threading.Thread(target=play)
    t.start()
    return t


def rank0(kube, ns):
    """The operator's rank-0 pod of the PyTorchJob, and its log."""
    from kubernetes import client

    client.CoreV1Api(kube.api()).create_namespaced_pod(ns, {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "llama-tiny-rank0", "namespace": ns, "labels": {
            "training.kubeflow.org/job-name": "llama-tiny", "training.kubeflow.org/replica-type": "master",
            "training.kubeflow.org/replica-index": "0"}},
        "spec": {"containers": [{"name": "pytorch", "image": "x"}]}, "status": {"phase": "Running"}})
    kube.route(f"get /api/v1/namespaces/{ns}/pods/llama-tiny-rank0/log", b"Batch 1 Loss: 3.1\n")


@pytest.mark.parametrize("flag", [None, "team-b"], ids=["context-namespace", "dash-n"])
def test_every_cluster_verb_acts_in_the_kubeconfig_s_namespace_or_in_dash_n_s(kube, tmp_path, monkeypatch,
                                                                                capsys, flag):
    require("kmock")
    ns = flag or "team-a"
    user = kube.user("team-user", EVERYTHING, namespace=ns, context_namespace="team-a")
    spec = str(write_spec(tmp_path))   # no namespace: in it
    n = ["-n", flag] if flag else []

    # A dry run's manifests carry it, every namespaced object.
    code, out, _ = run(monkeypatch, capsys, user, job_cli, "submit", spec, "--dry-run", "-o", "yaml", *n)
    docs = [d for d in yaml.safe_load_all(out) if d]
    assert code == 0 and docs
    assert {d["metadata"]["namespace"] for d in docs if d["kind"] != "PriorityClass"} == {ns}
    # Each verb, in the order a user runs them; its requests all go to the namespace.
    listing = json.dumps({"ok": True, "data": [{"name": "step-00000010", "step": 10, "kind": "fsdpkit",
                                                 "complete": True, "bytes": 1000, "loss": 2.9}]})
    verbs = [
        (job_cli, ["submit", spec], 0, f"submitted llama-tiny (pytorchjob, namespace {ns})"),
        (job_cli, ["status", "llama-tiny"], 0, f"llama-tiny ({ns}): "),
        (job_cli, ["list"], 0, "llama-tiny"),
        (job_cli, ["logs", "llama-tiny", "--timeout", "5"], 0, "Batch 1 Loss: 3.1"),
        (job_cli, ["watch", "llama-tiny", "--once", "--no-sample"], 0, ""),
        (job_cli, ["wait", "llama-tiny", "--timeout", "0.5", "--poll", "0.1"], 124, ""),   # still running
        (metrics_cli, ["llama-tiny", "--prometheus", "http://127.0.0.1:9"], None, ""),
        (ckpt_cli, ["list", "llama/checkpoints", "--pvc", "fsx-claim", "--image", "my/image:1"], 0, "step-00000010"),
        (ray_cli, ["status", "my-ray"], None, f"in namespace {ns}"),
        (ray_cli, ["create", spec, "--name", "my-ray", "--dry-run=server"], 0, ""),
        (ray_cli, ["create", spec, "--name", "my-ray"], 0, "RayCluster my-ray created"),
        (ray_cli, ["status", "my-ray"], 0, ""),
        (ray_cli, ["exec", "my-ray", "--", "true"], None, "head"),   # KubeRay has made no head pod here
        (ray_cli, ["delete", "my-ray", "--yes"], 0, ""),
        (job_cli, ["delete", "llama-tiny", "--yes"], 0, ""),
        # Its storage, Secret and job where its spec names no namespace (the cluster check is the
        # admin's, cluster-wide; watching is `job watch`'s, above).
        (deploy_cli, [spec, "--skip", "check,watch"], 0, "deployed llama-tiny"),
        (job_cli, ["delete", "llama-tiny", "--yes"], 0, ""),
    ]
    for cli, argv, want, says in verbs:
        if argv[0] == "logs":
            rank0(kube, ns)
        player = kubelet(kube, ns, listing) if cli is ckpt_cli else None
        before, dry_before = kube.request_count(), len(kube.dry_runs)
        at = argv.index("--") if "--" in argv else len(argv)   # -n before a command of its own
        code, out, err = run(monkeypatch, capsys, user, cli, *argv[:at], *n, *argv[at:])
        if player is not None:
            player.join()
        what = f"{cli.__name__.rsplit('.', 1)[-1]} {' '.join(argv)}"
        assert namespaces(kube, before, dry_before, what) == {ns}, (what, err)
        if want is not None:
            assert code == want, (what, err)
        else:   # answered by the cluster in the namespace: the job's lifetime read, no RayCluster or head yet
            assert code != 0 and "forbidden" not in err, (what, err)
        assert says in out + err, (what, out, err)
    assert kube.get_job("llama-tiny", namespace=ns) is None   # deleted where it was made


def leaves(parser, words=()):
    subs = subcommands(parser)
    if not subs:
        yield words, parser
    for word, sub in subs.items():
        yield from leaves(sub, (*words, word))


def test_every_command_that_takes_a_namespace_spells_it_dash_n_too():
    """One spelling on every verb: `-n` where `--namespace` is (job submit once lacked it, ray had neither)."""
    taking = {" ".join(words): {s for a in p._actions if "--namespace" in a.option_strings for s in a.option_strings}
              for verb in VERBS for words, p in leaves(verb_parser(verb), (verb,))}
    taking = {k: v for k, v in taking.items() if v}
    assert {"job submit", "job status", "job render", "ray create", "ray submit", "ray exec", "deploy",
            "metrics", "ckpt list"} <= set(taking)
    assert all(v == {"-n", "--namespace"} for v in taking.values()), taking


@pytest.mark.parametrize("flag", [None, "team-b"], ids=["context-namespace", "dash-n"])
def test_the_objects_the_admin_verbs_would_apply_are_in_that_namespace_too(tmp_path, flag):
    """The verbs whose namespaced objects are a cluster admin's to apply, read from their dry runs (no
    cluster): the FSx claim, etcd's member and Service, the NCCL test's MPIJob."""
    env = {"KUBECONFIG": kubeconfig(tmp_path, CONFIG)}
    n = ["-n", flag] if flag else []
    ns = flag or "team-a"

    def data(*argv):
        r = cli_here(*argv, *n, "--dry-run", "--json", env=env)
        assert r.returncode == 0, r.stdout + r.stderr
        return json.loads(r.stdout)["data"]
    claim = data("storage", "fsx", "create", "ckpt", "--region", "us-west-2")["kubernetes"]
    assert {o["kind"]: o["metadata"].get("namespace") for o in claim} == {"PersistentVolume": None,
                                                                          "PersistentVolumeClaim": ns}
    etcd = {s["object"]["metadata"].get("namespace") for s in data("cluster", "addons", "install", "--etcd")["steps"]
            if s["component"] == "etcd"}
    assert etcd == {ns}
    job = data("cluster", "validate", "nccl", "--nodes", "2", "--instance-type", "p5.48xlarge")["manifest"]
    assert job["kind"] == "MPIJob" and job["metadata"]["namespace"] == ns
