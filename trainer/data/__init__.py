"""The data: each process's loaders with DistributedSampler's sharding table (through ``Accelerator.prepare``), exact
evaluation shards, streams that resume mid-pass, and a ``datasets.Dataset``'s columns (docs/same-updates.md)."""
