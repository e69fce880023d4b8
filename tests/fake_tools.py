"""Stand-ins for tools this machine lacks, for tests that run the CLI end to end."""

# A stand-in for the Docker CLI (no Docker engine runs here): `push` puts an image manifest into the
# registry (moto's ECR), `inspect` answers with the repo digest the registry gave it, as Docker does;
# `info` and `buildx build` succeed; `run IMAGE CMD...` runs CMD here (this environment is the image).
FAKE_DOCKER = """#!{python}
import json, os, sys
import boto3
ecr = boto3.client("ecr", region_name="us-west-2", endpoint_url=os.environ["FSDPKIT_AWS_ENDPOINT_URL"])
cmd = sys.argv[1]
if cmd == "login":
    sys.stdin.read()
elif cmd == "run":
    args = sys.argv[2:]
    while args[0].startswith("-"):
        args = args[2:] if args[0] == "--gpus" else args[1:]
    os.execvp(args[1], args[1:])
elif cmd in ("push", "inspect"):
    uri = sys.argv[-1]
    repo, tag = uri.split("/", 1)[1].rsplit(":", 1)
    if cmd == "push":
        ecr.put_image(repositoryName=repo, imageTag=tag, imageManifest=json.dumps({{"schemaVersion": 2,
            "mediaType": "application/vnd.docker.distribution.manifest.v2+json", "config": {{"size": 1,
            "mediaType": "application/vnd.docker.container.image.v1+json", "digest": "sha256:" + "1" * 64}},
            "layers": []}}))
    else:
        image = ecr.describe_images(repositoryName=repo, imageIds=[{{"imageTag": tag}}])["imageDetails"][0]
        print(uri.rsplit(":", 1)[0] + "@" + image["imageDigest"])
"""


# A stand-in for the upstream installers `cluster addons install` and `cluster check --fix` run
# (`kubectl apply -k github.com/...`, `helm upgrade --install ...`): the upstream manifests are on
# GitHub and Helm repositories, out of reach here. For each upstream install command fsdpkit runs
# it creates in the cluster (kmock, at $KUBECONFIG's server) what that install leaves there: the
# operator's own CRDs (../shared/schemas holds the upstream files), its controller's Deployment
# under upstream's labels, Available, as the controller becomes once its image is pulled. Any
# other command fails, so a command fsdpkit changes without this table knowing shows as a failure.
FAKE_INSTALLER = """#!{python}
import json, os, re, sys, urllib.request
import yaml

SCHEMAS = {schemas!r}
line = " ".join(sys.argv[1:])
server = yaml.safe_load(open(os.environ["KUBECONFIG"]))["clusters"][0]["cluster"]["server"]

def post(path, obj):
    req = urllib.request.Request(server + path, data=json.dumps(obj).encode(), method="POST",
                                 headers={{"Content-Type": "application/json"}})
    urllib.request.urlopen(req, timeout=10).read()

def crds(*files):
    for f in files:
        post("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", yaml.safe_load(open(f"{{SCHEMAS}}/{{f}}")))

def controller(name, namespace, labels, image):
    post(f"/apis/apps/v1/namespaces/{{namespace}}/deployments", {{
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {{"name": name, "namespace": namespace,
                                                                   "labels": labels}},
        "spec": {{"template": {{"spec": {{"containers": [{{"name": "manager", "image": image}}]}}}}}},
        "status": {{"availableReplicas": 1}}}})

def daemonset(name, labels):
    post("/apis/apps/v1/namespaces/kube-system/daemonsets", {{
        "apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {{"name": name, "namespace": "kube-system",
                                                                  "labels": labels}},
        "status": {{"desiredNumberScheduled": 2, "numberReady": 2}}}})

tool = os.path.basename(sys.argv[0])
ref = re.search(r"ref=(v[\\d.]+)", line)
if tool == "kubectl" and line.startswith("apply") and "kubeflow/trainer.git/manifests/overlays/manager" in line:
    crds("trainer.kubeflow.org_trainjobs.yaml", "trainer.kubeflow.org_trainingruntimes.yaml",
         "trainer.kubeflow.org_clustertrainingruntimes.yaml", "jobset.x-k8s.io_jobsets.yaml")
    controller("kubeflow-trainer-controller-manager", "kubeflow-system",
               {{"app.kubernetes.io/name": "trainer", "app.kubernetes.io/component": "manager",
                "app.kubernetes.io/part-of": "kubeflow"}},
               f"ghcr.io/kubeflow/trainer/trainer-controller-manager:{{ref.group(1)}}")
    controller("jobset-controller-manager", "kubeflow-system", {{"app.kubernetes.io/name": "jobset"}},
               "registry.k8s.io/jobset/jobset:v0.8.1")
elif tool == "kubectl" and line.startswith("apply") and "kubeflow/trainer.git/manifests/overlays/runtimes" in line:
    post("/apis/trainer.kubeflow.org/v1alpha1/clustertrainingruntimes", {{
        "apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "ClusterTrainingRuntime",
        "metadata": {{"name": "torch-distributed"}}, "spec": {{"mlPolicy": {{"torch": {{}}}}}}}})
elif tool == "kubectl" and line.startswith("apply") and "training-operator.git/manifests/overlays/standalone" in line:
    crds("kubeflow.org_pytorchjobs.yaml")
    controller("training-operator", "kubeflow", {{"control-plane": "kubeflow-training-operator"}},
               f"kubeflow/training-operator:{{ref.group(1)}}")
elif tool == "kubectl" and line.startswith("apply") and "mpi-operator/v0.6.0/deploy/v2beta1/mpi-operator.yaml" in line:
    crds("kubeflow.org_mpijobs.yaml")
    controller("mpi-operator", "mpi-operator", {{"app.kubernetes.io/name": "mpi-operator"}},
               "mpioperator/mpi-operator:0.6.0")
elif tool == "kubectl" and line.startswith("apply") and "kubernetes-sigs/kueue/releases/download/" in line:
    crds(*(f"kueue.x-k8s.io_{{p}}.yaml" for p in ("clusterqueues", "localqueues", "resourceflavors", "workloads",
                                                "workloadpriorityclasses", "cohorts", "admissionchecks", "topologies")))
    controller("kueue-controller-manager", "kueue-system",
               {{"app.kubernetes.io/name": "kueue", "control-plane": "controller-manager"}},
               "registry.k8s.io/kueue/kueue:" + line.split("/download/")[1].split("/")[0])
elif tool == "kubectl" and line.startswith("apply") and "NVIDIA/k8s-device-plugin" in line:
    daemonset("nvidia-device-plugin-daemonset", {{"name": "nvidia-device-plugin-ds"}})
elif tool == "kubectl" and re.search(r"\\bwait --for=condition=Available\\b", line):
    pass   # the Deployment above is Available already
elif tool == "helm" and line.startswith("repo add "):
    pass
elif tool == "helm" and line.startswith("upgrade --install kuberay-operator kuberay/kuberay-operator"):
    crds("ray.io_rayclusters.yaml", "ray.io_rayjobs.yaml")
    controller("kuberay-operator", "default", {{"app.kubernetes.io/name": "kuberay-operator"}},
               "quay.io/kuberay/operator:v1.4.2")
elif tool == "helm" and line.startswith("upgrade --install aws-efa-k8s-device-plugin"):
    daemonset("aws-efa-k8s-device-plugin", {{"app.kubernetes.io/name": "aws-efa-k8s-device-plugin"}})
elif tool == "helm" and line.startswith("upgrade --install aws-fsx-csi-driver"):
    post("/apis/storage.k8s.io/v1/csidrivers", {{"apiVersion": "storage.k8s.io/v1", "kind": "CSIDriver",
                                                "metadata": {{"name": "fsx.csi.aws.com"}}}})
else:
    sys.exit(f"{{tool}} {{line}}: not an upstream install this stand-in knows")
with open(os.environ["FSDPKIT_TEST_INSTALLS"], "a") as log:
    log.write(f"{{tool}} {{line}}\\n")
"""
