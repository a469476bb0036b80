"""``python -m trainer.launch``: accelerate launch, ending as the trainer promises; it lives in
``trainer.launch.launcher``."""

from trainer.launch.launcher import main

if __name__ == "__main__":
    raise SystemExit(main())
