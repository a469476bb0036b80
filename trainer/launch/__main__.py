"""``python -m trainer.launch``: accelerate launch, ending as the trainer promises; it lives in
``trainer.tools.launcher``."""

from trainer.tools.launcher import main

raise SystemExit(main())
