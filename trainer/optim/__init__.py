"""The optimizer and its schedule from the config (or a user's factories), and an average of the weights (EMA)
(docs/project.md)."""
