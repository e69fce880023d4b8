"""Container images: Dockerfile rendering and PyTorch / CUDA / EFA conflict analysis (builds, image
tests, ECR and CodeBuild come with issue 6)."""
