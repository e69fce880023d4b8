"""What fsdpkit knows about EC2 / SageMaker HyperPod instance types, as data, and the defaults
derived from it (GPUs per node, EFA devices, NCCL / libfabric environment). A leaf: every stage
(planner, jobs, cluster checks, eksctl) reads it and it imports none of them.

Figures are from the EC2 accelerated-computing instance pages. `efa` is the number of EFA
interfaces a pod can request (`vpc.amazonaws.com/efa`); `rdma` is GPUDirect RDMA over EFA;
`net_gbps` the node's network bandwidth, which bounds a multi-node all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdpkit.errors import UserError


@dataclass(frozen=True)
class Instance:
    name: str
    accelerator: str          # "H100", "A10G", "Trainium", ...
    accelerators: int         # GPUs (or Trainium chips) per node
    accel_memory_gib: int     # per GPU / chip
    vcpus: int
    memory_gib: int
    efa: int                  # EFA interfaces (0: no EFA)
    rdma: bool                # GPUDirect RDMA over EFA
    resource: str = "nvidia.com/gpu"   # the Kubernetes extended resource for the accelerator
    net_gbps: int = 0                  # network bandwidth per node (Gbit/s)

    @property
    def family(self) -> str:
        return self.name.split(".")[0]


def _row(name: str, acc: str, n: int, mem: int, vcpus: int, ram: int, efa: int, rdma: bool, net: int,
         resource: str = "nvidia.com/gpu") -> Instance:
    return Instance(name, acc, n, mem, vcpus, ram, efa, rdma, resource, net)


INSTANCES: dict[str, Instance] = {i.name: i for i in [
    _row("p4d.24xlarge", "A100", 8, 40, 96, 1152, 4, True, 400),
    _row("p4de.24xlarge", "A100", 8, 80, 96, 1152, 4, True, 400),
    _row("p5.48xlarge", "H100", 8, 80, 192, 2048, 32, True, 3200),
    _row("p5e.48xlarge", "H200", 8, 141, 192, 2048, 32, True, 3200),
    _row("p5en.48xlarge", "H200", 8, 141, 192, 2048, 16, True, 3200),
    _row("g5.xlarge", "A10G", 1, 24, 4, 16, 0, False, 10),
    _row("g5.2xlarge", "A10G", 1, 24, 8, 32, 0, False, 10),
    _row("g5.4xlarge", "A10G", 1, 24, 16, 64, 0, False, 25),
    _row("g5.8xlarge", "A10G", 1, 24, 32, 128, 1, False, 25),
    _row("g5.16xlarge", "A10G", 1, 24, 64, 256, 1, False, 25),
    _row("g5.12xlarge", "A10G", 4, 24, 48, 192, 1, False, 40),
    _row("g5.24xlarge", "A10G", 4, 24, 96, 384, 1, False, 50),
    _row("g5.48xlarge", "A10G", 8, 24, 192, 768, 1, False, 100),
    _row("g6.xlarge", "L4", 1, 24, 4, 16, 0, False, 10),
    _row("g6.12xlarge", "L4", 4, 24, 48, 192, 1, False, 40),
    _row("g6.48xlarge", "L4", 8, 24, 192, 768, 1, False, 100),
    _row("g6e.xlarge", "L40S", 1, 48, 4, 32, 0, False, 20),
    _row("g6e.12xlarge", "L40S", 4, 48, 48, 384, 1, False, 100),
    _row("g6e.24xlarge", "L40S", 4, 48, 96, 768, 2, False, 200),
    _row("g6e.48xlarge", "L40S", 8, 48, 192, 1536, 4, False, 400),
    _row("trn1.2xlarge", "Trainium", 1, 32, 8, 32, 0, False, 12, "aws.amazon.com/neuron"),
    _row("trn1.32xlarge", "Trainium", 16, 32, 128, 512, 8, True, 800, "aws.amazon.com/neuron"),
    _row("trn1n.32xlarge", "Trainium", 16, 32, 128, 512, 16, True, 1600, "aws.amazon.com/neuron"),
]}

def lookup(instance_type: str) -> Instance:
    """The table row for `p5.48xlarge` or HyperPod's `ml.p5.48xlarge`; a UserError if unknown."""
    key = instance_type.removeprefix("ml.")
    if key not in INSTANCES:
        known = ", ".join(sorted(INSTANCES))
        raise UserError(f"instance_type: {instance_type!r} is not in fsdpkit's table; known: {known} "
                        "(or leave instance_type empty and give gpus_per_node and efa_per_node)")
    return INSTANCES[key]


def ofi_nccl_env(version: str | None) -> dict[str, str]:
    """What makes NCCL take the aws-ofi-nccl plugin (and fail, not fall back to TCP sockets, when
    it cannot), for the plugin generation in the image:
    - before 1.13 the plugin is libnccl-net.so and calls itself "AWS Libfabric";
    - 1.13-1.15 call it "Libfabric" and also answer to NCCL_NET=OFI (or "AWS Libfabric");
    - from 1.16 the library is libnccl-net-ofi.so (libnccl-net.so only where the build made one, not
      in NGC-style images), which NCCL loads with NCCL_NET_PLUGIN=ofi.
    Unknown version: "AWS Libfabric", the one name every generation answers to, with the default
    libnccl-net.so (what the EFA installer and the AWS Deep Learning Containers install)."""
    if version is None:
        return {"NCCL_NET": "AWS Libfabric"}
    major, minor = (int(x) for x in version.split(".")[:2])
    if (major, minor) < (1, 13):
        return {"NCCL_NET": "AWS Libfabric"}
    if (major, minor) < (1, 16):
        return {"NCCL_NET": "OFI"}
    return {"NCCL_NET": "OFI", "NCCL_NET_PLUGIN": "ofi"}


def network_env(inst: Instance | None, efa_devices: int, diagnose: bool = False,
                ofi_nccl: str | None = None, plugin: bool = True) -> dict[str, str]:
    """NCCL / libfabric variables for this instance. On EFA: the efa provider, NCCL forced onto the
    OFI plugin (fsdpkit.train.parallel.network then proves it was used), and GPUDirect RDMA on where the
    hardware has it (p4d, p4de, p5*); g5/g6/g6e with EFA have no GPUDirect RDMA, so libfabric must
    not try it and NCCL's Simple protocol is the one that is safe over EFA without it.
    `diagnose` adds NCCL's INFO log (INIT, NET) for `fsdpkit job logs --check-network`. Without the
    `plugin` in the image, NCCL is not pointed at it: NCCL would stop with "network not found"
    instead of running on TCP sockets (which the trainer then reports)."""
    env: dict[str, str] = {}
    if efa_devices > 0:
        env["FI_PROVIDER"] = "efa"
        if plugin and (inst is None or inst.resource == "nvidia.com/gpu"):   # Trainium's Neuron runtime is no NCCL
            env.update(ofi_nccl_env(ofi_nccl))
        if inst is not None and inst.rdma:
            env["FI_EFA_USE_DEVICE_RDMA"] = "1"
        elif inst is not None:
            env.update(FI_EFA_USE_DEVICE_RDMA="0", NCCL_PROTO="simple")
    if diagnose:
        env["NCCL_DEBUG"] = "INFO"
        env["NCCL_DEBUG_SUBSYS"] = "INIT,NET"
    return env
