"""Job spec and launchers: one typed JobSpec, rendered and run by a backend (local torchrun,
Kubeflow PyTorchJob, SageMaker HyperPod, Slurm)."""
