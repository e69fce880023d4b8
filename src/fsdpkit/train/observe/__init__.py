"""What a run reports: the metric line and its format, MFU and memory, TensorBoard and the trackers,
the record of a run across its attempts, and NCCL's own log read back."""
