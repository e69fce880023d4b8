"""Talking to a Kubernetes cluster: client set-up (kubeconfig, context, EKS) and error translation."""
