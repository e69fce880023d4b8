"""The sections of a JobSpec (fsdpkit.jobs.spec): storage, secrets by reference, HyperPod's
operator options, placement by topology, Kubeflow Trainer's runtime, Slurm. Each field's default
lives here and nowhere else; the rules between a section and the rest of the spec are spec.py's."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import model_validator

from fsdpkit.settings import Bool, Int, Settings, Str, fail, option


class Storage(Settings):
    """Where checkpoints and run outputs live: an existing PVC (FSx for Lustre, EFS) or a new one."""

    claim: Str | None = option(None, "an existing PersistentVolumeClaim (FSx for Lustre, EFS)")
    size: Str | None = option(None, "create NAME-ckpt of this size (a Kubernetes quantity)")
    storage_class: Str | None = option(None, "the storage class of the PVC created with size")
    access_mode: Literal["ReadWriteMany", "ReadWriteOnce", "ReadWriteOncePod", "ReadOnlyMany"] = option(
        "ReadWriteMany", "access mode of the PVC created with size")
    mount_path: Str = option("/checkpoints", "where the volume is mounted in the container")
    shared_path: Str | None = option(None, "Slurm and local jobs: a directory every node already mounts (/fsx)")
    # Sizes the time a stopping job is given to finish its checkpoint (fsdpkit.plan.grace).
    write_mb_per_s: Int = option(500, "the volume's aggregate write throughput in MB/s (FSx for Lustre: per-TiB "
                                 "tier x capacity)", ge=1)

    @property
    def enabled(self) -> bool:
        return bool(self.claim or self.size or self.shared_path)

    @property
    def root(self) -> str | None:
        """Where the job's outputs live inside the container or on the node."""
        if self.shared_path:
            return self.shared_path
        return self.mount_path if (self.claim or self.size) else None


class SecretRef(Settings):
    """An environment variable filled from a key of an existing Kubernetes Secret."""

    env: Str = option(..., "the variable's name")
    secret: Str = option(..., "the Secret's name")
    key: Str = option(..., "the key in the Secret")

    @model_validator(mode="before")
    @classmethod
    def _a_reference(cls, raw: Any) -> Any:
        if not isinstance(raw, dict):
            raise fail("give a reference {env, secret, key} to an existing Kubernetes Secret, not a value")
        return raw


class HyperPodOptions(Settings):
    operator: Literal["hyperpod", "kubeflow"] = option(
        "hyperpod", "hyperpod: the HyperPod training operator's HyperPodPyTorchJob (its elastic agent starts the "
        "workers); kubeflow: a Kubeflow PyTorchJob with HyperPod's auto-resume annotations (clusters that still "
        "run training operator 1.7-1.8)", what="a HyperPod job operator")
    auto_resume: Bool = option(True, "resume after HyperPod replaces a faulty node")
    max_retry: Int = option(3, "job retries (runPolicy.jobMaxRetryCount; kubeflow: job-max-retry-count)", ge=0)
    instance_group: Str | None = option(None, "the HyperPod instance group to run on")
    deep_health_check: Literal["preferred", "required", "off"] = option(
        "preferred", "run on nodes that passed HyperPod's deep health checks")
    restarts_before_full_restart: Int = option(
        3, "process-level restarts before the operator restarts the whole job (numRestartBeforeFullJobRestart)", ge=0)
    max_full_restarts: Int = option(1, "whole-job restarts before the job fails (maxFullJobRestarts)", ge=0)
    restart_eval_period: Int = option(21600, "seconds over which restarts are counted (evalPeriodSeconds)", ge=1)
    log_monitoring: Bool = option(True, "log-monitoring rules written from the trainer's own lines: it never "
                                  "started, it hangs, its loss is not finite or above loss_threshold")
    start_timeout: Int = option(1800, "seconds to the first step line before the job counts as never started",
                                ge=60)
    hang_timeout: Int | None = option(
        None, "seconds without a step line with a finite loss before the job counts as hung (default: from the "
        "planned step time, the logging interval and the checkpoint's write time)", ge=60)
    loss_threshold: Int | None = option(
        None, "a loss above this for 3 logging lines in a row is a bad run (default: twice the loss of a uniform "
        "guess, 2 ln(vocab))", ge=1)
    spares: Int = option(0, "spare nodes Kueue holds beside the job's own (replicaSpecs[].spares), so a faulty node "
                         "is replaced at once instead of after capacity frees up; needs queue", ge=0)
    repeat_offenders_to_avoid: Int | None = option(
        None, "nodes that failed more than once which a whole-job restart leaves out "
        "(restartPolicy.maxNumRepeatOffendersToAvoid; default: the spares, which take their place)", ge=0)
    scale_up_snooze: Int | None = option(
        None, "seconds after a job restart before it may be scaled up or readmitted "
        "(restartPolicy.scaleUpSnoozeTimeInSeconds; default: the operator's, 0)", ge=0)
    startup_deadline: Int | None = option(
        None, "seconds the job may be Starting before it fails (runPolicy.startupDeadlineSeconds; default: the "
        "planned start-up, see `fsdpkit plan`)", ge=60)
    fault_deadline: Int | None = option(
        None, "seconds the job may stay Faulted, stopping and starting again, before it fails "
        "(runPolicy.faultDeadlineSeconds; default: the grace a stop needs plus the planned start-up)", ge=60)


# Kueue's topology-aware scheduling reads these from a PodSet's pod template (sigs.k8s.io/kueue
# apis/kueue/v1alpha1: PodSetRequiredTopologyAnnotation, PodSetPreferredTopologyAnnotation).
KUEUE_REQUIRED_TOPOLOGY = "kueue.x-k8s.io/podset-required-topology"
KUEUE_PREFERRED_TOPOLOGY = "kueue.x-k8s.io/podset-preferred-topology"
# The node labels EKS and HyperPod give EC2's instance topology, from the spine (layer 1) down to the
# nodes' own switch (layer 3), and an UltraServer's id: the levels the HyperPod CLI accepts.
AWS_TOPOLOGY_LEVELS = ("topology.k8s.aws/network-node-layer-3", "topology.k8s.aws/network-node-layer-2",
                       "topology.k8s.aws/network-node-layer-1", "topology.k8s.aws/ultraserver-id")


class TopologyOptions(Settings):
    level: Str = option(AWS_TOPOLOGY_LEVELS[0], "the node label whose value the job's nodes should share: "
                        f"{', '.join(AWS_TOPOLOGY_LEVELS)} (closest first), or a level of your Kueue Topology")
    required: Bool = option(False, "true: wait until the nodes fit under one domain of that level; false: "
                            "prefer it, and take wider domains when they do not")

    @property
    def annotations(self) -> dict[str, str]:
        """The pod template's Kueue annotations: one of the two, never both (Kueue refuses that)."""
        return {KUEUE_REQUIRED_TOPOLOGY if self.required else KUEUE_PREFERRED_TOPOLOGY: self.level}


class TrainJobOptions(Settings):
    runtime: Str = option("torch-distributed", "the ClusterTrainingRuntime the TrainJob runs on: the cluster's "
                          "torch-distributed, or fsdpkit-torch (`fsdpkit cluster addons install --only trainer`)")


class SlurmOptions(Settings):
    partition: Str | None = option(None, "sbatch --partition")
    account: Str | None = option(None, "sbatch --account")
    time: Str | None = option(None, "sbatch --time, such as 2-00:00:00")
    container_image: Str | None = option(None, "pyxis/enroot image (REGISTRY#IMAGE:TAG); default: the spec's "
                                         "image, else the host's Python")
    container_mounts: list[Str] = option(default_factory=list, help="pyxis --container-mounts")
    script_dir: Str = option(".", "where the batch script is written")
    output: Str = option("%x-%j.out", "sbatch --output")
    hyperpod: Bool = option(False, "SageMaker HyperPod's Slurm: srun --auto-resume=1, so HyperPod replaces a faulty "
                            "node and runs the step again, which resumes from the newest checkpoint")

    def image(self, spec_image: str | None) -> str | None:
        """The image srun runs in: container_image, else the spec's image in pyxis's form (the
        registry, if there is one, joined to the path by '#')."""
        if self.container_image or not spec_image:
            return self.container_image
        first, _, rest = spec_image.partition("/")
        registry = rest and ("." in first or ":" in first or first == "localhost")
        return f"{first}#{rest}" if registry else spec_image
