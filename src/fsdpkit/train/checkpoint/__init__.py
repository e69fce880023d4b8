"""Sharded checkpoints: writing and resuming them (DCP), and the catalog of what a directory holds,
which reads names and metadata alone so the CLI lists checkpoints without torch."""
