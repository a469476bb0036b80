"""Checkpoints: the manager (a registry of parts that save and load themselves), the store that commits them
atomically, the parts that write files (the model and optimizer as torch DCP's shards under every strategy), the safe
DCP reader, what a resume may do, keep_best, background saves, and the export to files ``from_pretrained`` reads
(docs/checkpoints.md). One format: any checkpoint resumes under any strategy and process count.
"""
