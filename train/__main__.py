"""`python -m train {sft,grpo} ...` (or the `preft-train` console script): the training CLIs.

    preft-train sft --adapter lora --rank 8 --steps 50 --out runs/sft      = python -m train.sft ...
    preft-train grpo --steps 20 --out runs/grpo                             = python -m train.grpo ...

`preft-train sft --help` lists every flag with its default.
"""
from __future__ import annotations

import sys

COMMANDS = {"sft": ("train.sft", "supervised fine-tuning of one adapter"),
            "grpo": ("train.grpo", "GRPO of one adapter with verifiable rewards")}


def main(argv=None, prog: str = "python -m train") -> int:
    import importlib
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        if argv and argv[0] == "--version":
            from preft_jax import __version__
            print(f"preft-jax {__version__}")
            return 0
        usage = "\n".join(f"  {name:5s} {what}" for name, (_, what) in COMMANDS.items())
        print(f"usage: {prog} {{{','.join(COMMANDS)}}} [flags ...]   ({prog} COMMAND --help: its flags)\n\n"
              f"commands:\n{usage}", file=sys.stdout if argv[:1] in (["-h"], ["--help"]) else sys.stderr)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    module = importlib.import_module(COMMANDS[argv[0]][0])
    return module.main(argv[1:], prog=f"{prog} {argv[0]}")


def console() -> int:
    """The `preft-train` console script."""
    return main(prog="preft-train")


if __name__ == "__main__":
    sys.exit(main())
