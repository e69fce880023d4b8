"""`fsdpkit plan`: will a training config fit, how fast, how many nodes (memory, communication, time, cost)."""
