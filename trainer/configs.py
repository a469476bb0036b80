"""``python -m trainer.configs``: the command's public name; it lives in ``trainer.tools.configs``."""

from trainer.tools.configs import main

if __name__ == "__main__":
    raise SystemExit(main())
