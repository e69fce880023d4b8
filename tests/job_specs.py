"""Job specs and the training operator's side of a PyTorchJob, for the tests that submit to kmock."""

from __future__ import annotations

import datetime as dt

import yaml

from conftest import run_cli

TOKEN = "hf_s3cr3t_V4lue_never_printed"


GROUP, VERSION, PLURAL = "kubeflow.org", "v1", "pytorchjobs"


def write_spec(tmp_path, **fields):
    doc = {
        "name": "llama-tiny", "backend": "pytorchjob",
        "image": "123456789012.dkr.ecr.us-west-2.amazonaws.com/fsdpkit:1",
        "instance_type": "p5.48xlarge", "nodes": 2, "hf_token_env": "MY_HF_TOKEN",
        "storage": {"size": "1200Gi", "storage_class": "fsx-sc"},
        "train": {"preset": "tiny", "max_steps": 50, "checkpoint_freq": 10},
        **fields,
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def job_cli(kube, *args, env=None):
    return run_cli("job", *args, env={**kube.env, "MY_HF_TOKEN": TOKEN, **(env or {})}, timeout=120)


def writes(kube):
    return [(m, p.split("?")[0]) for m, p, _ in kube.requests() if m in ("POST", "PATCH", "PUT", "DELETE")]


def set_conditions(kube, name, *types):
    """Play the training operator: it patches the job's status subresource with its conditions."""
    from kubernetes import client

    conds = [{"type": t, "status": "True" if i == len(types) - 1 or t == "Created" else "False",
              "reason": f"PyTorchJob{t}", "message": f"PyTorchJob {name} is {t.lower()}.",
              "lastTransitionTime": f"2026-11-22T10:00:{i:02d}Z"} for i, t in enumerate(types)]
    client.CustomObjectsApi(kube.api()).patch_namespaced_custom_object_status(
        GROUP, VERSION, "default", PLURAL, name, {"status": {"conditions": conds}})


def stamp(seconds_ago: float) -> str:
    t = dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=seconds_ago)
    return t.strftime("%Y-%m-%dT%H:%M:%S.%f") + "123Z"  # nanoseconds, as the kubelet writes them


WORKLOADS = "/apis/kueue.x-k8s.io/v1beta2/namespaces/default/workloads"


class Kueue:
    """Play Kueue's controller: each job that appears on a queue gets a Workload owned by it, and the
    scheduler's verdict on it as Kueue writes it (QuotaReserved and Admitted conditions: reason and
    message). `verdict(job) -> (reserved, reason, message)` decides; a thread watches the jobs, and
    plays the garbage collector too: a Workload whose job is gone goes with it."""

    def __init__(self, kube, verdict, plural=PLURAL, kind="PyTorchJob"):
        import threading

        from kubernetes import client

        self.kube, self.verdict, self.plural, self.kind = kube, verdict, plural, kind
        self.stop, self.made = threading.Event(), []
        # What the garbage collector would have deleted since an earlier Kueue's last look (a job
        # deleted after it closed): gone before any job of this one's is made.
        self._collect(client.CustomObjectsApi(kube.api()))
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        from kubernetes import client

        api = client.CustomObjectsApi(self.kube.api())
        seen = set()
        while not self.stop.wait(0.1):
            jobs = self._collect(api)
            # A job deleted is forgotten: one made again under its name (kmock may give it the same
            # resourceVersion) is a new job, with a Workload of its own, as Kueue makes one.
            seen &= {(j["metadata"]["name"], j["metadata"].get("resourceVersion")) for j in jobs}
            for job in jobs:
                meta = job["metadata"]
                key = (meta["name"], meta.get("resourceVersion"))
                if key in seen or "kueue.x-k8s.io/queue-name" not in (meta.get("labels") or {}):
                    continue
                seen.add(key)
                reserved, reason, message = self.verdict(job)
                name = f"{self.kind.lower()}-{meta['name']}-{len(self.made):05x}"
                conditions = [{"type": "QuotaReserved", "status": "True" if reserved else "False", "reason": reason,
                               "message": message, "lastTransitionTime": "2026-11-28T00:00:00Z"}]
                if reserved:
                    conditions.append({"type": "Admitted", "status": "True", "reason": "Admitted",
                                       "message": "The workload is admitted",
                                       "lastTransitionTime": "2026-11-28T00:00:00Z"})
                self.kube.create(WORKLOADS, {
                    "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload",
                    "metadata": {"name": name, "namespace": "default",
                                 "labels": {"kueue.x-k8s.io/queue-name": meta["labels"]["kueue.x-k8s.io/queue-name"]},
                                 "ownerReferences": [{"apiVersion": f"{GROUP}/{VERSION}", "kind": self.kind,
                                                      "name": meta["name"], "uid": meta.get("uid", "uid-1"),
                                                      "controller": True, "blockOwnerDeletion": True}]},
                    "spec": {"queueName": meta["labels"]["kueue.x-k8s.io/queue-name"]},
                    "status": {"conditions": conditions}})
                self.made.append(name)

    def _collect(self, api) -> list[dict]:
        """The garbage collector's part: each Workload whose job is gone is deleted. The jobs, listed."""
        jobs = api.list_namespaced_custom_object(GROUP, VERSION, "default", self.plural)["items"]
        names = {j["metadata"]["name"] for j in jobs}
        for w in api.list_namespaced_custom_object("kueue.x-k8s.io", "v1beta2", "default", "workloads")["items"]:
            if not {o["name"] for o in w["metadata"].get("ownerReferences") or []} & names:
                api.delete_namespaced_custom_object("kueue.x-k8s.io", "v1beta2", "default", "workloads",
                                                    w["metadata"]["name"])
        return jobs

    def close(self):
        """Stop playing Kueue; what the garbage collector has left to delete (a job deleted since the
        last look) is deleted now, as it would be before a next job of the same name is submitted."""
        from kubernetes import client

        self.stop.set()
        self.thread.join(5)
        self._collect(client.CustomObjectsApi(self.kube.api()))
