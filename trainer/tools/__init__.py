"""The commands: ``python -m trainer.check`` (preflight; ``--resume-proof``), ``python -m trainer.export``,
``python -m trainer.plot`` and ``python -m trainer.configs`` (the shipped accelerate configs); their public names are
the shims at the package's top (docs/checkpoints.md, docs/clusters.md, docs/metrics.md, docs/launching.md)."""
