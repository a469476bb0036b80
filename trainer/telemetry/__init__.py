"""What a job reports: the log window and its one gather per log, the sinks (metrics files, wandb from every process
in one group, TensorBoard), the console, MFU, naming a stalled rank, and profiling (docs/metrics.md)."""
