"""fsdpkit: train Llama-family models with PyTorch FSDP2 and run them on AWS clusters."""

__version__ = "0.1.0"
