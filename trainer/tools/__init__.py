"""The commands: ``python -m trainer.check`` (preflight), ``python -m trainer.export`` and ``python -m trainer.plot``;
their public names are the shims at the package's top (docs/checkpoints.md, docs/clusters.md, docs/metrics.md)."""
