"""The help layout of every `siding` command's parser (the coordinator's, the worker's, each
benchmark's): here, in the one package all of them import."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.RawDescriptionHelpFormatter,
                    argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default after its help, except where there is nothing to say (no default,
    a flag) or the help says it already; descriptions as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if any(action.default is x for x in (None, False, True, argparse.SUPPRESS)) or (
                action.default == "" or "(default" in (action.help or "")):
            return action.help or ""
        return super()._get_help_string(action)
