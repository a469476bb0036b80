"""Draw every rank's curves from ``<output_dir>/metrics/rank<k>.jsonl`` into one PNG, no wandb needed.

    python -m trainer.plot runs/gpt2                 # writes runs/gpt2/metrics/curves.png
    python -m trainer.plot runs/gpt2 --out curves.png

Four panels, one line per rank: the loss of each rank's own shard (with the global mean and eval loss from the
main process), throughput, and the two parts of a step each rank does alone: the forward pass and waiting for
data, where a straggler stands out; then the gradient norm, and a panel for each figure you logged
(``trainer.log``, or added in ``on_log``), one line per rank. Needs matplotlib
(``pip install "accelerate-ddp-trainer[plot]"``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trainer.telemetry.sinks import read_metrics

# (title, y label, per-rank key, main-process keys drawn over the ranks)
PANELS = (
    ("loss", "loss", "rank/loss", ("global/train_loss", "eval/loss")),
    ("throughput", "examples / s", "rank/examples_per_s", ()),
    # Step time is wall time, equal on every rank (the gradient all-reduce waits for the slowest): the forward
    # pass, which each rank runs alone, is where a straggler shows.
    ("forward pass", "seconds per optimizer step", "rank/forward_s", ()),
    ("data wait", "seconds per optimizer step", "rank/data_wait_s", ()),
)


def plot(output_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the curves of every rank under ``output_dir`` to ``out`` (default ``<output_dir>/metrics/curves.png``)."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit('trainer.plot needs matplotlib: pip install "accelerate-ddp-trainer[plot]"') from None
    # No display needed.
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = read_metrics(output_dir)
    if not ranks:
        raise SystemExit(f"no metrics under {Path(output_dir) / 'metrics'}: has a run with this output_dir logged?")
    out = Path(out or Path(output_dir) / "metrics" / "curves.png")
    drawn = panels(ranks)
    rows = (len(drawn) + 1) // 2
    figure, axes = plt.subplots(rows, 2, figsize=(12, 4 * rows), constrained_layout=True, squeeze=False)
    for ax in axes.flat[len(drawn) :]:
        ax.set_visible(False)
    for ax, (title, ylabel, key, main_keys) in zip(axes.flat, drawn, strict=False):
        for rank, rows in sorted(ranks.items()):
            _curve(ax, rows, key, style="-", label=f"rank {rank}")
        for main_key in main_keys:
            _curve(
                ax, ranks.get(0, []), main_key, style="k--" if main_key.startswith("global") else "ko-", label=main_key
            )
        ax.set(title=title, xlabel="optimizer step", ylabel=ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    figure.suptitle(f"{Path(output_dir).name}: {len(ranks)} rank(s)")
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=100)
    plt.close(figure)
    return out


def panels(ranks: dict[int, list[dict]]) -> list[tuple[str, str, str | None, tuple[str, ...]]]:
    """The built-in panels, the gradient norm's when it was logged, and one for each figure a user logged."""
    # Numbers only: "MFU": "41.5%" is not drawn.
    keys = {
        key for rows in ranks.values() for row in rows for key, value in row.items() if isinstance(value, (int, float))
    }
    found = list(PANELS)
    if "global/grad_norm" in keys:
        found.append(("gradient norm", "norm before clipping", None, ("global/grad_norm",)))
    own = sorted(key for key in keys if "/" not in key and key not in ("step", "time", "rank", "error", "preempted"))
    return found + [(name, name, name, ()) for name in own]


def _curve(ax, rows: list[dict], key: str | None, *, style: str, label: str) -> None:
    if key is None:
        return
    steps = [row["step"] for row in rows if key in row]
    if steps:
        ax.plot(steps, [row[key] for row in rows if key in row], style, label=label, linewidth=1.2)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m trainer.plot", description=__doc__.splitlines()[0])
    parser.add_argument("output_dir", help="a run's output_dir (it holds metrics/rank<k>.jsonl)")
    parser.add_argument("--out", help="the PNG to write (default <output_dir>/metrics/curves.png)")
    args = parser.parse_args(argv)
    print(f"curves of every rank written to {plot(args.output_dir, args.out)}")


if __name__ == "__main__":
    main(sys.argv[1:])
