"""``python -m trainer.check``: the command's public name; it lives in ``trainer.tools.preflight``."""

from trainer.tools.preflight import main

if __name__ == "__main__":
    raise SystemExit(main())
