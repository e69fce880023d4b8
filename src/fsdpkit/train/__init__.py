"""The training program: what runs under torchrun, on a laptop or inside a pod.

It imports nothing from the cloud side of fsdpkit, so it runs in a bare training container.
"""
