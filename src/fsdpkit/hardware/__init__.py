"""The hardware catalog: instance types and accelerator peaks, as data. Imports nothing else of fsdpkit
but its errors, so every stage can read it."""
