"""Loading shows a bar of layers on a terminal, and nothing when stderr is a file or a pipe."""

from __future__ import annotations

import io
import sys

from worker.loaders import progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_sees_the_layers_counted(monkeypatch):
    monkeypatch.setattr(sys, "stderr", Terminal())
    assert list(progress.layers(15, 30)) == list(range(15, 30))
    shown = sys.stderr.getvalue()
    assert "loading layers 15-29" in shown and "0/15 [" in shown


def test_a_pipe_sees_nothing(monkeypatch):
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert list(progress.layers(0, 4)) == [0, 1, 2, 3]
    assert sys.stderr.getvalue() == ""
