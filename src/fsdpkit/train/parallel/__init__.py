"""FSDP2 over the device mesh (with activation checkpointing and compile around each block), and the
proof that collectives run on the network expected (EFA, not TCP sockets)."""
