"""`python -m fsdpkit.train [flags]`: the entry point torchrun starts in every process."""

from fsdpkit.train.launch import main
from fsdpkit.train.runtime.dist import leave

leave(main())
