"""The `siding` command's own behaviour: flags where a user puts them, clear errors, pipes."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from coordinator.cli import build_parser
from coordinator.config import CoordinatorConfig


@pytest.mark.parametrize("argv, debug", [
    (["status"], False), (["--debug", "status"], True), (["status", "--debug"], True),
    (["generate", "hi", "--debug"], True), (["--debug", "launch"], True),
])
def test_debug_goes_before_or_after_the_command(argv, debug):
    assert build_parser().parse_args(argv).debug is debug


@pytest.mark.parametrize("flag, value", [("listen", "foo"), ("listen", "tcp://nohostport"),
                                         ("worker_listen", "udp://1.2.3.4:5")])
def test_a_bad_endpoint_is_named_as_one(flag, value):
    with pytest.raises(ValueError, match="give an endpoint such as tcp://"):
        CoordinatorConfig(**{flag: value})


def run_cli(*args: str, stdout=subprocess.PIPE) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "coordinator", *args], stdout=stdout,
                          stderr=subprocess.PIPE, text=True, timeout=120)


def test_a_closed_pipe_ends_quietly(tmp_path):
    r, w = os.pipe()
    os.close(r)  # as `| head -1` does once it has its line
    try:
        out = run_cli("keys", str(tmp_path / "keys"), stdout=w)
    finally:
        os.close(w)
    assert out.returncode == 1 and out.stderr == "", out.stderr


def test_a_metrics_port_in_use_is_named_with_its_address():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = run_cli("launch", "--model", "synthetic:tiny", "--metrics-port", str(port),
                      "--listen", "tcp://127.0.0.1:*", "--worker-listen", "tcp://127.0.0.1:*")
    assert out.returncode == 1
    assert f"--metrics-port {port}: cannot listen on 127.0.0.1:{port}" in out.stderr, out.stderr


@pytest.mark.parametrize("flag, other", [("--listen", "--worker-listen"),
                                         ("--worker-listen", "--listen")])
def test_a_zeromq_port_in_use_is_named_with_its_flag(flag, other):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        endpoint = f"tcp://127.0.0.1:{taken.getsockname()[1]}"
        out = run_cli("launch", "--model", "synthetic:tiny", flag, endpoint, other,
                      "tcp://127.0.0.1:*", "--metrics-port", "0")
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert f"siding: error: {flag} {endpoint}: cannot listen" in out.stderr, out.stderr
    assert "Address already in use" in out.stderr


@pytest.mark.parametrize("command", [["status"], ["generate", "hi"], ["generate", "hi",
                                                                      "--stream"]])
def test_a_cluster_that_is_not_running_is_answered_in_seconds_with_a_hint(command):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens on it once closed
    t0 = time.monotonic()
    r = run_cli(*command, "--endpoint", f"tcp://127.0.0.1:{port}")
    assert time.monotonic() - t0 < 60  # its silence timeout (3 s), not its timeout (600 s)
    assert r.returncode == 1 and "is a cluster running? Start one with `siding launch`" in (
        r.stderr), r.stderr


def test_more_workers_than_layers_are_refused_before_any_process_starts():
    r = run_cli("launch", "--model", "synthetic:tiny", "--workers", "5")
    assert r.returncode == 1 and r.stderr == (
        "siding: error: --workers 5: synthetic:tiny has 4 layers; at most 4 workers\n")


def launch_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["launch"]


def launch_options() -> list[argparse.Action]:
    return [a for a in launch_parser()._actions
            if a.option_strings and a.help != argparse.SUPPRESS and a.dest != "help"]


def test_every_option_of_launch_is_described_and_in_the_readme(monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # argparse wraps at the terminal's width
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    for action in launch_options():
        flag = action.option_strings[0]
        assert action.help, f"{flag} has no help"
        assert f"| `{flag}" in readme or f"`, `{flag}" in readme, f"{flag} is not in the README"
    text = launch_parser().format_help()
    assert "(default: 1024)" in text and "(default: tcp://127.0.0.1:5555)" in text


def subcommand(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def test_chat_offers_no_options_that_make_no_sense_for_one_streamed_reply():
    flags = {f for a in subcommand("chat")._actions for f in a.option_strings}
    assert "-n" not in flags and "--stream" not in flags and "--json" not in flags
    assert "-n" in {f for a in subcommand("generate")._actions for f in a.option_strings}


def test_an_endpoint_without_transport_means_tcp():
    args = build_parser().parse_args(["status", "--endpoint", "localhost:17999,10.0.0.2:5555"])
    assert args.endpoint == "tcp://localhost:17999,tcp://10.0.0.2:5555"


def test_a_bad_client_endpoint_is_refused_naming_the_flag_and_the_form():
    r = run_cli("status", "--endpoint", "localhost")
    assert r.returncode == 2
    assert "argument --endpoint: 'localhost' is not an endpoint: give tcp://HOST:PORT" in (
        r.stderr), r.stderr


def test_an_unreadable_api_key_file_is_named_with_its_flag(tmp_path):
    missing = tmp_path / "nonexistent"
    r = run_cli("launch", "--api-key-file", str(missing))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert f"siding: error: --api-key-file {missing}: cannot read it: No such file" in (
        r.stderr), r.stderr


class Parsed(Exception):
    """Raised in place of parsing, carrying the parser a command built."""


def scenario_parser(name: str, monkeypatch) -> argparse.ArgumentParser:
    from benchmarks.__main__ import scenario

    def capture(parser, *args, **kwargs):
        raise Parsed(parser)

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", capture)
        with pytest.raises(Parsed) as parsed:
            scenario(name).main([])
    return parsed.value.args[0]


def every_parser(monkeypatch) -> dict[str, argparse.ArgumentParser]:
    from benchmarks.__main__ import scenarios
    from worker.process import build_parser as worker_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parsers = {"siding": build_parser(), "siding worker": worker_parser()}
    parsers.update({f"siding {name}": p for name, p in sub.choices.items() if name != "worker"})
    parsers.update({f"siding bench {name}": scenario_parser(name, monkeypatch)
                    for name in scenarios()})
    return parsers


def test_every_option_of_every_command_is_described_with_its_default(monkeypatch):
    undescribed, no_default = [], []
    for command, parser in every_parser(monkeypatch).items():
        formatter = parser._get_formatter()
        for action in parser._actions:
            if action.help == argparse.SUPPRESS or isinstance(
                    action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            name = f"{command} {(action.option_strings or [action.dest])[0]}"
            if not action.help:
                undescribed.append(name)
            elif action.option_strings and action.default not in (
                    None, True, False, "", argparse.SUPPRESS) and "(default" not in (
                    formatter._get_help_string(action)):
                no_default.append(name)
    assert undescribed == [], undescribed
    assert no_default == [], no_default
