"""Provisioning: eksctl ClusterConfigs validated against eksctl's own JSON schema; `cluster create|delete`
with the placement group and eksctl; add-ons installed once against kmock; FSx for Lustre against
moto in server mode with its PersistentVolume and claim on kmock; bad input as one-line errors.

What the fakes lack, and how the tests stand in for it:
- moto 5.2 implements no EC2 placement groups. `cluster create|delete` run against a small EC2/STS
  responder below that keeps placement groups the way EC2 does and records each call.
- moto's FSx answers without `Lifecycle` and `MountName` (a real file system has both) and has no
  data repository associations. The `fsx_service` fixture plays FSx's side on moto's own stored
  objects: a new file system is CREATING and turns AVAILABLE (or FAILED) when the test says so,
  and it gets a mount name, as the service assigns one.
"""

from __future__ import annotations

import copy
import http.server
import json
import threading
import urllib.parse
from typing import ClassVar

import pytest
import yaml
from http_reply import XML, QuietHandler

from conftest import aws_client, run_cli
from kube_objects import trainer_v2
from manifest_schemas import crd_validator, eksctl_validator, validate_builtin

CR = "cr-0123456789abcdef0"
EFA_INTERFACES = {"p4d.24xlarge": 4, "p5.48xlarge": 32, "p5en.48xlarge": 16, "g5.8xlarge": 1, "g6e.12xlarge": 1}


def render(instance: str, nodes: int, **choices) -> dict:
    """The ClusterConfig `fsdpkit cluster config` writes (the CLI path itself: the tests below)."""
    from fsdpkit.aws.eksctl import ClusterPlan
    from fsdpkit.aws.eksctl import render as render_config

    return render_config(ClusterPlan("llm", "us-west-2", instance, nodes, **choices))


@pytest.mark.parametrize("reserved", [False, True], ids=["on-demand", "capacity-reservation"])
@pytest.mark.parametrize("instance", sorted(EFA_INTERFACES))
def test_cluster_config_validates_against_eksctls_schema(instance, reserved):
    validator = eksctl_validator()
    extra = {"capacity_reservation": CR, "zone": "us-west-2c"} if reserved else {}
    config = render(instance, 4, **extra)
    errors = [f"{'/'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(config)]
    assert not errors, errors
    system, gpu = config["managedNodeGroups"]
    assert (system["name"], gpu["name"], gpu["instanceType"]) == ("system", "gpu", instance)
    assert gpu["desiredCapacity"] == gpu["minSize"] == gpu["maxSize"] == 4
    # EFA: every one of these types has it; one zone and a cluster placement group for the group.
    assert gpu["efaEnabled"] is True
    assert gpu["labels"]["fsdpkit.dev/efa-interfaces"] == str(EFA_INTERFACES[instance])
    assert gpu["availabilityZones"] == ["us-west-2c" if reserved else "us-west-2a"]
    assert gpu["placement"] == {"groupName": "llm-gpu"}
    assert len(config["availabilityZones"]) == 2 and gpu["availabilityZones"][0] in config["availabilityZones"]
    assert gpu["volumeSize"] == 500 and gpu["amiFamily"] == "AmazonLinux2023"
    if reserved:
        assert gpu["capacityReservation"] == {"capacityReservationTarget": {"capacityReservationID": CR}}
    else:
        assert "capacityReservation" not in gpu
    assert [a["name"] for a in config["addons"]] == ["vpc-cni", "coredns", "kube-proxy", "aws-ebs-csi-driver",
                                                     "aws-fsx-csi-driver"]
    assert config["iam"] == {"withOIDC": True}


def test_config_without_efa_and_with_a_capacity_block():
    validator = eksctl_validator()
    plain = render("g5.4xlarge", 1)  # no EFA on this size
    block = render("p5.48xlarge", 2, capacity_reservation=CR, zone="us-west-2b", capacity_block=True,
                   placement_group="my-pg")
    for config in (plain, block):
        assert not list(validator.iter_errors(config))
    gpu = plain["managedNodeGroups"][1]
    assert "efaEnabled" not in gpu and "placement" not in gpu and "fsdpkit.dev/efa-interfaces" not in gpu["labels"]
    gpu = block["managedNodeGroups"][1]
    assert gpu["instanceMarketOptions"] == {"marketType": "capacity-block"}
    assert gpu["placement"] == {"groupName": "my-pg"}
    # The schema is strict: a typo'd field or a wrong type is refused, so the checks above can fail.
    broken = copy.deepcopy(block)
    broken["managedNodeGroups"][1]["volumeSize"] = "500"
    broken["managedNodeGroups"][1]["efaEnable"] = True
    assert len(list(validator.iter_errors(broken))) == 2


def test_cluster_config_cli_writes_the_file_and_the_envelope(tmp_path):
    out = tmp_path / "cluster.yaml"
    r = run_cli("cluster", "config", "--name", "llm", "--region", "us-west-2", "--instance-type", "p5en.48xlarge",
                "--nodes", "3", "--out", str(out), "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)["data"]
    assert data["path"] == str(out) and yaml.safe_load(out.read_text()) == data["config"] == render("p5en.48xlarge", 3)
    assert "next: fsdpkit cluster create --config" in r.stderr


@pytest.mark.parametrize(("args", "message"), [
    (["--instance-type", "p9.96xlarge", "--nodes", "2"], "instance_type: 'p9.96xlarge' is not in fsdpkit's table"),
    (["--instance-type", "g5.4xlarge", "--nodes", "2", "--efa", "on"],
     "efa: g5.4xlarge has no EFA interface (in its family: g5.12xlarge, g5.16xlarge"),
    (["--instance-type", "p5.48xlarge", "--nodes", "0"], "nodes: 0 is out of range (at least 1)"),
    (["--instance-type", "p5.48xlarge", "--nodes", "2", "--capacity-reservation", "cr-123", "--zone", "us-west-2a"],
     "capacity_reservation: 'cr-123' is not a reservation id"),
    (["--instance-type", "p5.48xlarge", "--nodes", "2", "--capacity-reservation", CR],
     "zone: a capacity reservation lives in one availability zone"),
    (["--instance-type", "p5.48xlarge", "--nodes", "2", "--zone", "us-east-1a"],
     "zone: 'us-east-1a' is not an availability zone of us-west-2"),
])
def test_bad_cluster_config_is_one_line_and_writes_nothing(tmp_path, args, message):
    out = tmp_path / "cluster.yaml"
    r = run_cli("cluster", "config", "--name", "llm", "--region", "us-west-2", *args, "--out", str(out))
    assert r.returncode == 2
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert list(tmp_path.iterdir()) == []


# --- cluster create / delete ----------------------------------------------------------------------------
class _Ec2(QuietHandler):
    """EC2's placement-group calls (and STS's GetCallerIdentity), answered as EC2 does, calls recorded."""

    groups: ClassVar[dict] = {}
    calls: ClassVar[list] = []

    def do_POST(self):
        body = urllib.parse.parse_qs(self.rfile.read(int(self.headers["Content-Length"])).decode())
        p = {k: v[0] for k, v in body.items()}
        action = p["Action"]
        type(self).calls.append((action, p.get("GroupName") or p.get("GroupName.1")))
        ns = 'xmlns="http://ec2.amazonaws.com/doc/2016-11-15/"'
        if action == "GetCallerIdentity":
            xml = ('<GetCallerIdentityResponse xmlns="https://sts.amazonaws.com/doc/2011-06-15/">'
                   "<GetCallerIdentityResult><Arn>arn:aws:iam::123456789012:user/t</Arn><UserId>AIDA</UserId>"
                   "<Account>123456789012</Account></GetCallerIdentityResult>"
                   "<ResponseMetadata><RequestId>1</RequestId></ResponseMetadata></GetCallerIdentityResponse>")
            return self._send(200, xml)
        name = p.get("GroupName") or p.get("GroupName.1")
        if action == "DescribePlacementGroups":
            if name not in self.groups:
                return self._send(400, "<Response><Errors><Error><Code>InvalidPlacementGroup.Unknown</Code><Message>"
                                       f"The Placement Group '{name}' is unknown.</Message></Error></Errors>"
                                       "<RequestID>1</RequestID></Response>")
            tags = "".join(f"<item><key>{k}</key><value>{v}</value></item>" for k, v in self.groups[name].items())
            return self._send(200, f"<DescribePlacementGroupsResponse {ns}><requestId>1</requestId><placementGroupSet>"
                                   f"<item><groupName>{name}</groupName><strategy>cluster</strategy><state>available"
                                   f"</state><tagSet>{tags}</tagSet></item></placementGroupSet>"
                                   "</DescribePlacementGroupsResponse>")
        if action == "CreatePlacementGroup":
            assert p["Strategy"] == "cluster"
            self.groups[name] = {p[k]: p[k.replace("Key", "Value")] for k in p if k.endswith(".Key")}
            return self._send(200, f"<CreatePlacementGroupResponse {ns}><requestId>1</requestId><placementGroup>"
                                   f"<groupName>{name}</groupName></placementGroup></CreatePlacementGroupResponse>")
        if action == "DeletePlacementGroup":
            self.groups.pop(name)
            return self._send(200, f"<DeletePlacementGroupResponse {ns}><requestId>1</requestId><return>true</return>"
                                   "</DeletePlacementGroupResponse>")
        return self._send(400, f"<Response><Errors><Error><Code>InvalidAction</Code><Message>{action}</Message>"
                               "</Error></Errors></Response>")

    def _send(self, status, xml):
        self.reply(status, xml.encode(), XML)


@pytest.fixture
def ec2(tmp_path):
    handler = type("Ec2", (_Ec2,), {"groups": {}, "calls": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "FSDPKIT_AWS_ENDPOINT_URL": f"http://127.0.0.1:{server.server_port}",
           "AWS_CONFIG_FILE": str(tmp_path / "none"), "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none")}
    yield handler, env
    server.shutdown()


def test_create_makes_the_placement_group_once_runs_eksctl_and_delete_removes_both(ec2, tmp_path):
    handler, env = ec2
    config = tmp_path / "cluster.yaml"
    assert run_cli("cluster", "config", "--name", "llm", "--region", "us-west-2", "--instance-type", "p5.48xlarge",
                   "--nodes", "2", "--out", str(config)).returncode == 0
    # Without eksctl: the placement group is made, and the exact command is handed back.
    r = run_cli("cluster", "create", "--config", str(config), "--json", env={**env, "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)["data"]
    assert out == {"cluster": "llm", "region": "us-west-2", "placement_groups_created": ["llm-gpu"], "ran": False,
                   "command": ["eksctl", "create", "cluster", "-f", str(config)]}
    assert handler.groups == {"llm-gpu": {"fsdpkit:managed": "true"}}
    # With eksctl on PATH it runs; the group exists now and is not created twice.
    bin_dir, log = tmp_path / "bin", tmp_path / "eksctl.log"
    bin_dir.mkdir()
    (bin_dir / "eksctl").write_text(f'#!/bin/sh\necho "$@" >> {log}\n')
    (bin_dir / "eksctl").chmod(0o755)
    path_env = {**env, "PATH": f"{bin_dir}:/usr/bin:/bin"}
    r = run_cli("cluster", "create", "--config", str(config), env=path_env)
    assert r.returncode == 0, r.stderr
    assert "placement group llm-gpu: exists" in r.stdout
    assert [c for c in handler.calls if c[0] == "CreatePlacementGroup"] == [("CreatePlacementGroup", "llm-gpu")]
    # Delete asks first; with --yes it runs eksctl, then removes fsdpkit's group.
    r = run_cli("cluster", "delete", "--config", str(config), env=path_env)
    assert r.returncode == 2 and "add --yes to confirm" in r.stderr
    r = run_cli("cluster", "delete", "--config", str(config), "--yes", "--json", env=path_env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["data"]["placement_groups_deleted"] == ["llm-gpu"]
    assert log.read_text().splitlines() == [f"create cluster -f {config}", f"delete cluster -f {config} --wait"]
    assert handler.groups == {}


def test_create_dry_run_calls_nothing(ec2, tmp_path):
    handler, env = ec2
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(render("p4d.24xlarge", 2)))
    r = run_cli("cluster", "create", "--config", str(config), "--dry-run", env=env)
    assert r.returncode == 0
    assert r.stdout.splitlines() == ["would create placement group llm-gpu",
                                     f"would run: eksctl create cluster -f {config}"]
    assert handler.calls == []
    config.write_text("kind: Pod\n")
    r = run_cli("cluster", "create", "--config", str(config), env=env)
    assert r.returncode == 2 and "is not an eksctl ClusterConfig" in r.stderr


# --- add-ons ------------------------------------------------------------------------------------------
def test_addons_install_twice_creates_each_object_once(kube, tmp_path):
    env = {**kube.env, "PATH": "/nonexistent"}  # neither kubectl nor helm: the operators are reported, not run
    # Trainer v2 is already installed (CRDs, JobSet, a ready controller, upstream's runtime), as
    # `kubectl apply -k` leaves it; fsdpkit's runtime is added beside it, once.
    trainer_v2(kube)
    first = run_cli("cluster", "addons", "install", "--etcd", "--json", env=env)
    second = run_cli("cluster", "addons", "install", "--etcd", "--json", env=env)
    for r in (first, second):
        assert r.returncode == 0, r.stderr
    steps = [[(s["component"], s["action"]) for s in json.loads(r.stdout)["data"]["steps"]] for r in (first, second)]
    actions = [dict(s) for s in steps]
    assert actions[0]["nvidia"] == actions[0]["efa"] == actions[0]["etcd"] == "created"
    assert actions[1]["nvidia"] == actions[1]["efa"] == actions[1]["etcd"] == "exists"
    assert [a for c, a in steps[0] if c == "trainer"] == ["exists", "created"]   # upstream's, then fsdpkit-torch
    assert [a for c, a in steps[1] if c == "trainer"] == ["exists", "exists"]
    assert "training-operator" not in actions[0]  # the legacy v1 operator only when named
    (runtime,) = [b for m, p, b in kube.requests()
                  if m == "POST" and p.split("?")[0].endswith("/clustertrainingruntimes")
                  and b["metadata"]["name"] == "fsdpkit-torch"]
    assert not list(crd_validator("trainer.kubeflow.org_clustertrainingruntimes.yaml").iter_errors(runtime))
    assert actions[0]["kuberay"].startswith("not run (helm not installed)")
    steps = {s["component"]: s for s in json.loads(first.stdout)["data"]["steps"]}
    assert "--version 1.4.2" in steps["kuberay"]["what"]
    posts = [p for m, p, _ in kube.requests() if m == "POST" and ("kube-system" in p or "/default/" in p)]
    assert all(p.endswith("?fieldValidation=Strict") for p in posts)   # fsdpkit's own creates are strict
    posts = [p.split("?")[0] for p in posts]
    assert sorted(posts) == [
        "/api/v1/namespaces/default/services", "/apis/apps/v1/namespaces/default/deployments",
        "/apis/apps/v1/namespaces/kube-system/daemonsets", "/apis/apps/v1/namespaces/kube-system/daemonsets"]
    created = [b for m, p, b in kube.requests() if m == "POST" and ("kube-system" in p or "/default/" in p)]
    for obj in created:
        validate_builtin(obj)
    # The readiness checks ran afterwards and see the device plugins (no GPU node: nothing to schedule yet).
    verdict = {c["name"]: c["status"] for c in json.loads(second.stdout)["data"]["checks"]}
    assert verdict["NVIDIA device plugin"] == "pass" and verdict["Kubeflow Trainer v2"] == "pass"
    assert verdict["KubeRay operator"] == "warn"


def test_addons_dry_run_and_bad_component(kube):
    r = run_cli("cluster", "addons", "install", "--only", "nvidia,efa", "--dry-run", env=kube.env)
    assert r.returncode == 0
    docs = [d for d in yaml.safe_load_all(r.stdout) if d]
    assert [d["metadata"]["name"] for d in docs] == ["nvidia-device-plugin-daemonset", "aws-efa-k8s-device-plugin"]
    assert not [m for m, _, _ in kube.requests() if m == "POST"]
    r = run_cli("cluster", "addons", "install", "--only", "nvidia,gpu-operator", env=kube.env)
    assert r.returncode == 2 and "--only: gpu-operator is not one of" in r.stderr


# --- FSx for Lustre -------------------------------------------------------------------------------------
@pytest.fixture
def fsx_service(moto, monkeypatch):
    """FSx's side of the lifecycle on moto's stored file systems (see the module docstring)."""
    from moto.fsx import models

    # A new file system answers CREATING to its first `creating_reads` reads (its own create
    # included), then settles in `settles_to`: FSx's order, independent of how fast the CLI starts.
    state = {"lifecycle": "CREATING", "creating_reads": 3, "settles_to": "AVAILABLE", "failure": None}
    plain = models.FileSystem.to_dict

    def to_dict(self):
        d = plain(self)
        if state["lifecycle"] == "CREATING":
            state["creating_reads"] -= 1
            if state["creating_reads"] < 0:
                state["lifecycle"] = state["settles_to"]
        d["Lifecycle"] = state["lifecycle"]
        if state["failure"] and state["lifecycle"] == "FAILED":
            d["FailureDetails"] = {"Message": state["failure"]}
        d["LustreConfiguration"] = {**(d.get("LustreConfiguration") or {}), "MountName": "abcd1234"}
        return d

    monkeypatch.setattr(models.FileSystem, "to_dict", to_dict)
    url, env = moto
    ec2 = aws_client(url, "ec2")
    vpc = ec2.create_vpc(CidrBlock="10.0.0.0/16")["Vpc"]["VpcId"]
    subnets = [ec2.create_subnet(VpcId=vpc, CidrBlock=f"10.0.{i}.0/24", AvailabilityZone=f"us-west-2{z}")["Subnet"]
               ["SubnetId"] for i, z in enumerate("ab")]
    other_vpc = ec2.create_vpc(CidrBlock="10.9.0.0/16")["Vpc"]["VpcId"]
    stray = ec2.create_subnet(VpcId=other_vpc, CidrBlock="10.9.0.0/24")["Subnet"]["SubnetId"]
    sg = ec2.create_security_group(GroupName="eks-cluster-sg-llm", Description="cluster", VpcId=vpc)["GroupId"]
    aws_client(url, "eks").create_cluster(name="llm", roleArn="arn:aws:iam::123456789012:role/eks",
                                          resourcesVpcConfig={"subnetIds": subnets, "securityGroupIds": [sg]})
    return {"url": url, "env": env, "state": state, "subnets": subnets, "stray": stray, "sg": sg}


def stored_request(fs_id):
    """moto's stored file system: what CreateFileSystem asked for, fields the describe output omits."""
    from moto.fsx.models import fsx_backends

    return fsx_backends["123456789012"]["us-west-2"].file_systems[fs_id]


def test_fsx_create_waits_for_available_then_makes_the_volume_and_claim(fsx_service, kube, tmp_path):
    svc = fsx_service
    env = {**svc["env"], **kube.env}
    r = run_cli("storage", "fsx", "create", "ckpt", "--size", "2400", "--throughput", "250", "--eks-cluster", "llm",
                "--security-group-id", svc["sg"], "--poll", "0.2", "--json", env=env)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)["data"]
    fs_id = out["file_system_id"]
    assert out["created"] is True and out["lifecycle"] == "AVAILABLE" and out["claim"] == "ckpt"
    assert (out["size_gib"], out["deployment_type"], out["throughput_per_tib"]) == (2400, "PERSISTENT_2", 250)
    assert out["subnet_ids"] == [svc["subnets"][0]]
    lines = r.stderr.splitlines()
    assert any(f"FSx {fs_id}: CREATING" in x for x in lines) and any(f"FSx {fs_id}: AVAILABLE" in x for x in lines)
    stored = aws_client(svc["url"], "fsx").describe_file_systems()["FileSystems"]
    assert len(stored) == 1 and {"Key": "fsdpkit:fsx", "Value": "ckpt"} in stored[0]["Tags"]
    # FSx's describe output has no security groups; moto's stored object shows what was asked for.
    assert stored_request(fs_id).security_group_ids == [svc["sg"]]
    pv, pvc = [b for m, p, b in kube.requests() if m == "POST"]
    for obj in (pv, pvc):
        validate_builtin(obj)
    assert pv["spec"]["csi"] == {"driver": "fsx.csi.aws.com", "volumeHandle": fs_id, "volumeAttributes": {
        "dnsname": f"{fs_id}.fsx.us-west-2.amazonaws.com", "mountname": "abcd1234"}}
    assert pv["spec"]["persistentVolumeReclaimPolicy"] == "Retain"
    assert pvc["spec"]["volumeName"] == pv["metadata"]["name"] and pvc["spec"]["resources"]["requests"] == {
        "storage": "2400Gi"}
    # Again: the same file system and claim, nothing new.
    r = run_cli("storage", "fsx", "create", "ckpt", "--size", "2400", "--throughput", "250", "--eks-cluster", "llm",
                "--poll", "0.2", "--json", env=env)
    assert r.returncode == 0 and json.loads(r.stdout)["data"]["created"] is False
    assert len(aws_client(svc["url"], "fsx").describe_file_systems()["FileSystems"]) == 1
    assert len([m for m, _, _ in kube.requests() if m == "POST"]) == 2
    r = run_cli("storage", "fsx", "status", "ckpt", "--json", env=env)
    assert json.loads(r.stdout)["data"]["mount_name"] == "abcd1234"
    # Delete: asks first (a dry run shows what would go); then the claim and volume, then the file system.
    assert run_cli("storage", "fsx", "delete", "ckpt", env=env).returncode == 2
    r = run_cli("storage", "fsx", "delete", "ckpt", "--dry-run", "--json", env=env)
    assert json.loads(r.stdout)["data"]["file_system"]["file_system_id"] == fs_id
    assert not [m for m, _, _ in kube.requests() if m == "DELETE"]
    r = run_cli("storage", "fsx", "delete", "ckpt", "--yes", "--json", env=env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["data"]["deleted"] == fs_id
    assert aws_client(svc["url"], "fsx").describe_file_systems()["FileSystems"] == []
    assert [p for m, p, _ in kube.requests() if m == "DELETE"] == [
        "/api/v1/namespaces/default/persistentvolumeclaims/ckpt", "/api/v1/persistentvolumes/ckpt-fsx"]


def test_fsx_failure_is_one_line_with_the_services_reason(fsx_service):
    svc = fsx_service
    svc["state"].update(settles_to="FAILED", failure="The subnet has no free IP addresses.")
    r = run_cli("storage", "fsx", "create", "data", "--deployment-type", "SCRATCH_2", "--s3", "s3://corpus/tok",
                "--eks-cluster", "llm", "--poll", "0.2", "--no-k8s", env=svc["env"])
    assert r.returncode == 3
    assert r.stderr.strip().splitlines()[-1].endswith("is FAILED: The subnet has no free IP addresses.")
    (fs,) = aws_client(svc["url"], "fsx").describe_file_systems()["FileSystems"]
    lustre = stored_request(fs["FileSystemId"]).lustre_configuration
    assert lustre["ImportPath"] == "s3://corpus/tok" and "PerUnitStorageThroughput" not in lustre


@pytest.mark.parametrize(("args", "message"), [
    (["--size", "3000"], "size: 3000 GiB is not a valid PERSISTENT_2 size (1200, 2400 or a multiple of 2400; "
                         "nearest: 2400 or 4800)"),
    (["--throughput", "200"], "throughput: PERSISTENT_2 takes 125, 250, 500, 1000 MB/s per TiB, not 200"),
    (["--deployment-type", "SCRATCH_2", "--throughput", "200"], "throughput: SCRATCH_2 takes no throughput setting"),
    (["--s3", "bucket/prefix"], "s3: 'bucket/prefix' is not an S3 URL"),
    (["--eks-cluster", "nope"], "eks_cluster: no EKS cluster 'nope' in us-west-2"),
])
def test_bad_fsx_input_is_one_line_and_creates_nothing(fsx_service, args, message):
    svc = fsx_service
    r = run_cli("storage", "fsx", "create", "ckpt", *(args if "--eks-cluster" in args else
                                                      [*args, "--eks-cluster", "llm"]), env=svc["env"])
    assert r.returncode == 2
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert aws_client(svc["url"], "fsx").describe_file_systems()["FileSystems"] == []


def test_subnet_from_another_vpc_is_refused(fsx_service):
    svc = fsx_service
    r = run_cli("storage", "fsx", "create", "ckpt", "--eks-cluster", "llm", "--subnet-id", svc["stray"],
                env=svc["env"])
    assert r.returncode == 2
    assert f"subnet_id: {svc['stray']} is in vpc-" in r.stderr and "but cluster llm is in vpc-" in r.stderr
    assert aws_client(svc["url"], "fsx").describe_file_systems()["FileSystems"] == []


def test_storage_class_for_dynamic_provisioning(kube):
    r = run_cli("storage", "fsx", "storage-class", "fsx-scratch", "--deployment-type", "SCRATCH_2", "--subnet-id",
                "subnet-0abc", "--security-group-id", "sg-1", "--security-group-id", "sg-2", "--json", env=kube.env)
    assert r.returncode == 0, r.stderr
    (sc,) = [b for m, p, b in kube.requests() if m == "POST"]
    validate_builtin(sc)
    assert sc["provisioner"] == "fsx.csi.aws.com" and sc["parameters"] == {
        "subnetId": "subnet-0abc", "securityGroupIds": "sg-1,sg-2", "deploymentType": "SCRATCH_2",
        "fileSystemTypeVersion": "2.15"}
    r = run_cli("storage", "fsx", "storage-class", "fsx-scratch", "--deployment-type", "SCRATCH_2", "--subnet-id",
                "subnet-0abc", "--security-group-id", "sg-1", "--json", env=kube.env)
    assert json.loads(r.stdout)["data"]["action"] == "exists"


def test_fsx_dry_run_calls_nothing(tmp_path):
    env = {"FSDPKIT_AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_REGION": "us-west-2"}
    r = run_cli("storage", "fsx", "create", "ckpt", "--size", "4800", "--dry-run", "--json", env=env)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)["data"]
    assert out["create_file_system"]["StorageCapacity"] == 4800
    assert out["create_file_system"]["LustreConfiguration"]["PerUnitStorageThroughput"] == 125
    assert [o["kind"] for o in out["kubernetes"]] == ["PersistentVolume", "PersistentVolumeClaim"]

