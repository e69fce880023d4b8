"""Container images: the Dockerfile, PyTorch / CUDA / EFA conflict analysis, and the digests of
pushed images that jobs are pinned to."""
