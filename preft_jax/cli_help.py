"""One `--help` style for every command line (python -m preft_jax / serve / train.sft / train.grpo /
preft_jax.cache and the preft-jax / preft-serve / preft-train console scripts).

    ap = argparse.ArgumentParser(prog="python -m serve", formatter_class=HelpFormatter, ...)

Each flag's help ends with "(default: X)" unless there is nothing to show (None, False, an empty
list) or its help already speaks of its default; descriptions keep their line breaks.
"""
from __future__ import annotations

import argparse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if ("default" in text.lower() or default is None or default is False or default == []
                or default is argparse.SUPPRESS or not (action.option_strings or action.nargs == "?")):
            return text
        return text + " (default: %(default)s)"
