"""``python -m trainer.plot``: the command's public name; it lives in ``trainer.tools.plot``."""

from trainer.tools.plot import main

if __name__ == "__main__":
    raise SystemExit(main())
