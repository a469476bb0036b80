"""``python -m trainer.export``: the command's public name; it lives in ``trainer.tools.export``."""

from trainer.tools.export import main

if __name__ == "__main__":
    raise SystemExit(main())
