"""Checkpoints on shared storage: latest and prune here, and the same verbs on a PVC through a
short-lived helper pod (kmock plays the kubelet; the pod's output is our own `ckpt list --json`)."""

from __future__ import annotations

import json
import threading
import time

from conftest import require, run_cli


def fabricate(root):
    """Checkpoint directories as they lie on disk: two complete fsdpkit ones, one whose save did not
    finish, and one of the reference example (its naming: MODEL-Nsteps)."""
    for step in (10, 20):
        d = root / f"step-{step:08d}"
        d.mkdir(parents=True)
        (d / "fsdpkit.json").write_text(json.dumps({"step": step, "world_size": 2, "loss": 3.0 - step / 100}))
        (d / "__0_0.distcp").write_bytes(b"x" * 1000)
    (root / ".step-00000030.tmp").mkdir()
    ref = root / "llama_v3-40steps"
    ref.mkdir()
    (ref / ".metadata").write_bytes(b"m")
    return root


def test_latest_and_prune_understand_both_namings(tmp_path):
    root = fabricate(tmp_path / "ckpt")
    r = run_cli("ckpt", "list", str(root), "--json")
    rows = json.loads(r.stdout)["data"]
    assert [(x["name"], x["kind"], x["complete"]) for x in rows] == [
        ("step-00000010", "fsdpkit", True), ("step-00000020", "fsdpkit", True),
        (".step-00000030.tmp", "fsdpkit", False), ("llama_v3-40steps", "reference", True)]
    r = run_cli("ckpt", "latest", str(root), "--json")
    assert json.loads(r.stdout)["data"]["name"] == "llama_v3-40steps"
    r = run_cli("ckpt", "prune", str(root), "--keep", "1", "--dry-run")
    assert r.stdout.strip() == "would delete step-00000010" and (root / "step-00000010").exists()
    # Deleting asks first: with no terminal to ask and no --yes, one line and nothing deleted.
    r = run_cli("ckpt", "prune", str(root), "--older-than-days", "0")
    assert (r.returncode, r.stderr) == (2, "error: delete: removes checkpoints step-00000010; add --yes to confirm\n")
    # --keep -1 once deleted a checkpoint and exited 0 (found[-keep:]).
    before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    r = run_cli("ckpt", "prune", str(root), "--keep", "-1", "--yes")
    assert r.returncode == 2 and "--keep: -1 is below 0" in r.stderr and r.stderr.count("\n") == 1
    assert {p: p.read_bytes() for p in root.rglob("*") if p.is_file()} == before  # every byte still there
    r = run_cli("ckpt", "prune", str(root), "--older-than-days", "0", "--yes")
    assert r.returncode == 0 and r.stdout.strip() == "deleted step-00000010"
    # The newest complete fsdpkit checkpoint, the unfinished save and the reference's stay.
    assert sorted(p.name for p in root.iterdir()) == [".step-00000030.tmp", "llama_v3-40steps", "step-00000020"]
    r = run_cli("ckpt", "latest", str(tmp_path / "empty-does-not-exist"))
    assert r.returncode == 2 and "checkpoint directory not found" in r.stderr


def test_list_on_a_pvc_runs_a_helper_pod_and_removes_it(kube, tmp_path):
    require("kmock")
    root = fabricate(tmp_path / "ckpt")
    listing = run_cli("ckpt", "list", str(root), "--json").stdout  # what the pod would print
    from kubernetes import client

    core = client.CoreV1Api(kube.api())

    def kubelet():
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            posts = [b for m, p, b in kube.requests() if m == "POST" and p.split("?")[0].endswith("/pods")]
            if posts:
                name = posts[0]["metadata"]["name"]
                kube.route(f"get /api/v1/namespaces/default/pods/{name}/log", listing.encode())
                core.patch_namespaced_pod_status(name, "default", {"status": {"phase": "Succeeded"}})
                return
            time.sleep(0.1)
    t = threading.Thread(target=kubelet)
    t.start()
    r = run_cli("ckpt", "list", "llama/checkpoints", "--pvc", "fsx-claim", "--image", "my/image:1", "--json",
                env=kube.env, timeout=60)
    t.join()
    assert r.returncode == 0, r.stderr
    assert [x["name"] for x in json.loads(r.stdout)["data"]][:2] == ["step-00000010", "step-00000020"]
    pod = next(b for m, p, b in kube.requests() if m == "POST" and p.split("?")[0].endswith("/pods"))
    spec = pod["spec"]
    assert spec["containers"][0]["command"] == ["python", "-m", "fsdpkit", "ckpt", "list", "/ckpt/llama/checkpoints",
                                                "--json"]
    assert spec["volumes"] == [{"name": "data", "persistentVolumeClaim": {"claimName": "fsx-claim"}}]
    assert spec["restartPolicy"] == "Never"
    name = pod["metadata"]["name"]
    assert ("DELETE", f"/api/v1/namespaces/default/pods/{name}") in [(m, p.split("?")[0]) for m, p, _ in
                                                                      kube.requests()]


def test_pvc_without_image_is_one_line():
    r = run_cli("ckpt", "list", "x", "--pvc", "fsx-claim")
    assert r.returncode == 2 and r.stderr.strip() == (
        "error: --pvc needs --image: an image with fsdpkit installed (your training image)")
