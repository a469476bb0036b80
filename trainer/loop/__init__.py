"""The training loop's parts: one optimizer step (``step``), what each micro-batch's loss weighs (``weighing``), the
default loss and the packed-batch probe, ``auto_microbatch``, the NaN guard, evaluation and prediction, callbacks and
where training stands. None of them asks which strategy runs: they call the ``Strategy`` (docs/same-updates.md).
"""
