"""``python -m trainer.check``: the command's public name; it lives in ``trainer.tools.preflight`` (the preflight) and
``trainer.tools.resume_proof`` (``--resume-proof``)."""

import sys

from trainer.tools import preflight, resume_proof


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--resume-proof"]:
        return resume_proof.main(argv[1:])
    return preflight.main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
