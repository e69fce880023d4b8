"""The processes a run is: device and process group, torchrun under a supervisor and its elastic agent,
the checkpoint directory's run lock, host memory, and fault injection for recovery tests."""
