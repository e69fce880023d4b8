"""Kubernetes objects for FSx for Lustre through its CSI driver (fsx.csi.aws.com): a static
PersistentVolume + PersistentVolumeClaim for a file system that exists (what job specs name in
`storage.claim`), or a StorageClass that lets the driver create one per claim."""

from __future__ import annotations

from typing import Any

DRIVER = "fsx.csi.aws.com"
MANAGED = {"app.kubernetes.io/managed-by": "fsdpkit"}


def static_volume(name: str, namespace: str, file_system_id: str, dns_name: str, mount_name: str,
                  size_gib: int) -> list[dict[str, Any]]:
    """PV bound to exactly one PVC (claimRef + volumeName), so no other claim can take it. Retain:
    deleting the claim never deletes checkpoints."""
    pv_name = f"{name}-fsx"
    pv = {
        "apiVersion": "v1", "kind": "PersistentVolume",
        "metadata": {"name": pv_name, "labels": MANAGED},
        "spec": {
            "capacity": {"storage": f"{size_gib}Gi"},
            "volumeMode": "Filesystem",
            "accessModes": ["ReadWriteMany"],
            "persistentVolumeReclaimPolicy": "Retain",
            "storageClassName": "",
            "mountOptions": ["flock"],
            "claimRef": {"namespace": namespace, "name": name},
            "csi": {"driver": DRIVER, "volumeHandle": file_system_id,
                    "volumeAttributes": {"dnsname": dns_name, "mountname": mount_name}},
        },
    }
    pvc = {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim",
        "metadata": {"name": name, "namespace": namespace, "labels": MANAGED},
        "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "", "volumeName": pv_name,
                 "resources": {"requests": {"storage": f"{size_gib}Gi"}}},
    }
    return [pv, pvc]


def storage_class(name: str, subnet_id: str, security_group_ids: list[str], deployment_type: str,
                  throughput: int | None, s3_import: str = "") -> dict[str, Any]:
    """Dynamic provisioning: each claim of this class gets its own file system (parameters as the
    FSx CSI driver documents them; all values are strings)."""
    params = {"subnetId": subnet_id, "securityGroupIds": ",".join(security_group_ids),
              "deploymentType": deployment_type, "fileSystemTypeVersion": "2.15"}
    if throughput:
        params["perUnitStorageThroughput"] = str(throughput)
    if deployment_type.startswith("PERSISTENT"):
        params["dataCompressionType"] = "LZ4"
    if s3_import:
        params["s3ImportPath"] = s3_import
    return {"apiVersion": "storage.k8s.io/v1", "kind": "StorageClass",
            "metadata": {"name": name, "labels": MANAGED}, "provisioner": DRIVER,
            "reclaimPolicy": "Retain", "volumeBindingMode": "Immediate", "mountOptions": ["flock"],
            "parameters": params}
