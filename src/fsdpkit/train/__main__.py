"""`python -m fsdpkit.train [flags]`: the entry point torchrun starts in every process."""

from fsdpkit.train.dist import leave
from fsdpkit.train.launch import main

leave(main())
