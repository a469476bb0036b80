"""The loop's parts against a run of one process, in this pytest process: the strategy and the step runner (an
accumulation window is the mean over its micro-batches, as one batch of them all; a NaN window skipped under
nan_policy skip), the evaluator (every example once, its metrics exact), and telemetry (a log row, a user's figures,
what fit() returns, the metrics file). Launched jobs prove the same
across processes (tests/loop/test_same_updates.py, tests/loop/test_evaluation.py, tests/telemetry/test_tracking.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from trainer import TrainConfig
from trainer.data.loaders import Loaders
from trainer.launch.run import Run
from trainer.loop.evaluation import Evaluator
from trainer.loop.step import StepRunner
from trainer.optim import build as optim
from trainer.parallel import for_run
from trainer.state import TrainState
from trainer.telemetry.telemetry import Telemetry


def mse(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


@pytest.fixture
def run(tmp_path):
    return Run.join(TrainConfig(output_dir=str(tmp_path), optimizer="sgd", lr=0.1, batch_size=2))


def rows(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(3, generator=g), torch.randn(1, generator=g)) for _ in range(count)]


def stepped(run: Run, window: int, data: list) -> torch.nn.Module:
    """One optimizer step over ``data`` in micro-batches of ``run.config.batch_size``, ``window`` a step."""
    config = run.config.replace(gradient_accumulation_steps=window, batch_size=len(data) // window)
    run = Run(config=config, accelerator=run.accelerator, layout=run.layout, mesh=run.mesh, dp=run.dp, host=run.host)
    strategy = for_run(run)
    torch.manual_seed(0)
    model = strategy.apply(torch.nn.Linear(3, 1), prebuilt_optimizer=False)
    built = optim.build(model, config, optimizer=None, lr_scheduler=None, total_steps=1)
    model = strategy.prepare(model, built.optimizer)
    telemetry = Telemetry(run)
    steps = StepRunner(run, strategy, model, optimization=built, loss_fn=mse, window=telemetry.window)
    steps.begin()
    loader = torch.utils.data.DataLoader(data, batch_size=config.batch_size)
    (only,) = list(steps.windows(loader))
    steps.run(only, 1, measure_norm=True)
    return strategy.unwrap(model)


def test_a_window_of_micro_batches_steps_as_one_batch_of_them_all(run):
    data = rows(8)
    whole, accumulated = stepped(run, 1, data), stepped(run, 4, data)
    for mine, theirs in zip(whole.parameters(), accumulated.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-7)
    torch.manual_seed(0)
    by_hand = torch.nn.Linear(3, 1)
    x, y = torch.stack([r[0] for r in data]), torch.stack([r[1] for r in data])
    torch.nn.functional.mse_loss(by_hand(x), y).backward()
    with torch.no_grad():
        for parameter in by_hand.parameters():
            parameter -= 0.1 * parameter.grad
    for mine, theirs in zip(whole.parameters(), by_hand.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-7)


def test_the_evaluator_counts_every_example_once_and_its_metrics_exactly(run):
    strategy, data = for_run(run), rows(5)
    model = strategy.apply(torch.nn.Linear(3, 1), prebuilt_optimizer=False)
    loaders = Loaders(run, model=model, train_data=None, eval_data=data)
    steps = StepRunner(
        run,
        strategy,
        model,
        optimization=optim.build(model, run.config, optimizer=None, lr_scheduler=None, total_steps=1),
        loss_fn=mse,
        window=Telemetry(run).window,
    )
    evaluator = Evaluator(
        run,
        strategy,
        model,
        loss_fn=mse,
        metrics_fn=lambda model, batch: {"target": batch[1].reshape(-1)},
        weighing=steps.weighing,
        data=loaders,
    )
    metrics = evaluator.evaluate(step=0)
    assert metrics["eval_examples"] == 5
    targets = [float(r[1]) for r in data]
    assert metrics["eval_target"] == pytest.approx(sum(targets) / 5, rel=1e-12)
    x, y = torch.stack([r[0] for r in data]), torch.stack([r[1] for r in data])
    # A batch's mean loss weighed by its examples: the whole set's mean.
    assert metrics["eval_loss"] == pytest.approx(float(torch.nn.functional.mse_loss(model(x), y)), rel=1e-6)


def test_telemetry_logs_a_row_says_what_fit_returns_and_closes_its_metrics_file(run, tmp_path):
    telemetry = Telemetry(run)
    telemetry.open("unit", step=0)
    state = TrainState(4, 1, run_id="unit")
    for step in (1, 2):
        telemetry.window.add(torch.tensor(float(step)), step, (torch.zeros(2, 3),), examples=2)
        telemetry.window.stepped()
        state.stepped(1)
    rows = telemetry.gather(stop=False, lr=0.1)
    seen = []
    bar = SimpleNamespace(set_postfix=lambda **figures: None)
    telemetry.log(rows, state=state, total_steps=4, on_log=lambda metrics: seen.append(metrics), progress=bar)
    assert seen[0]["train_loss"] == 1.5 and seen[0]["step"] == 2 and telemetry.log_history == seen
    result = telemetry.result(state, started=0.0, skipped=0, stopped=None)
    assert result["global_step"] == 2 and result["train_loss"] == 1.5 and result["epoch"] == 0.5
    with telemetry.closing():
        pass
    written = [json.loads(line) for line in (tmp_path / "metrics" / "rank0.jsonl").read_text().splitlines()]
    assert written[0]["step"] == 2 and written[0]["global/train_loss"] == 1.5


def test_a_non_finite_window_under_nan_policy_skip_leaves_weights_buffers_and_schedule_as_they_were(run):
    """nan_policy skip: a window whose loss is NaN takes no update, puts the buffers its forward moved back (a
    BatchNorm's running mean), leaves the schedule where it was and counts a skipped step; the next window steps.
    tests/checkpoint/test_checkpoint.py proves the same through 2 processes, resumed."""
    config = run.config.replace(nan_policy="skip", lr_scheduler="linear", warmup_steps=0)
    run = Run(config=config, accelerator=run.accelerator, layout=run.layout, mesh=run.mesh, dp=run.dp, host=run.host)
    strategy = for_run(run)
    torch.manual_seed(0)
    model = strategy.apply(
        torch.nn.Sequential(torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 1)), prebuilt_optimizer=False
    )
    built = optim.build(model, config, optimizer=None, lr_scheduler=None, total_steps=4)
    model = strategy.prepare(model, built.optimizer)
    steps = StepRunner(run, strategy, model, optimization=built, loss_fn=mse, window=Telemetry(run).window)
    steps.begin()
    good = rows(2)
    bad = [(x, torch.tensor([float("nan")])) for x, _ in good]
    before = {name: tensor.clone() for name, tensor in strategy.unwrap(model).state_dict().items()}
    (window,) = list(steps.windows(torch.utils.data.DataLoader(bad, batch_size=2)))
    steps.run(window, 1, measure_norm=True)
    after = strategy.unwrap(model).state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before if "num_batches" not in name)
    assert steps.nonfinite.skipped_steps == 1 and built.scheduler.last_epoch == 0
    (window,) = list(steps.windows(torch.utils.data.DataLoader(good, batch_size=2)))
    steps.run(window, 2, measure_norm=True)
    moved = strategy.unwrap(model).state_dict()
    assert not torch.equal(moved["1.weight"], before["1.weight"]) and built.scheduler.last_epoch == 1
    assert not torch.equal(moved["0.running_mean"], before["0.running_mean"])


def test_the_figures_a_user_logs_are_each_names_mean_since_the_last_log_in_the_row_and_the_history(run):
    """trainer.log's figures (Telemetry.add): a tensor read only at the log, each name's mean over its calls since
    the last log, in the step's metrics beside the trainer's own; the next log starts afresh."""
    telemetry = Telemetry(run)
    telemetry.open("unit", step=0)
    state = TrainState(4, 1, run_id="unit")
    bar = SimpleNamespace(set_postfix=lambda **figures: None)
    seen = []
    for step, values in ((1, (1.0, 3.0)), (2, (5.0,))):
        for value in values:
            telemetry.add({"aux": torch.tensor(value)})
        telemetry.window.add(torch.tensor(0.5), step, (torch.zeros(2, 3),), examples=2)
        telemetry.window.stepped()
        state.stepped(1)
        rows = telemetry.gather(stop=False, lr=0.1)
        telemetry.log(rows, state=state, total_steps=4, on_log=lambda metrics: seen.append(metrics), progress=bar)
    assert [metrics["aux"] for metrics in seen] == [2.0, 5.0]
    assert all(metrics["train_loss"] == 0.5 for metrics in seen) and telemetry.log_history == seen
    with telemetry.closing():
        pass
