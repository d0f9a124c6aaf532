"""`--http` addresses and who may serve HTTP where: the same rule as the ZeroMQ endpoint."""

from __future__ import annotations

import pytest

from coordinator.cli import build_parser, config_from_args
from coordinator.config import CoordinatorConfig
from coordinator.http.address import parse_address, url


@pytest.mark.parametrize("text, want", [
    ("127.0.0.1:8000", ("127.0.0.1", 8000)),
    ("http://127.0.0.1:8000/", ("127.0.0.1", 8000)),
    ("[::1]:8000", ("::1", 8000)),
    (":8000", ("127.0.0.1", 8000)),
    ("8000", ("127.0.0.1", 8000)),
    ("0.0.0.0:0", ("0.0.0.0", 0)),
])
def test_addresses(text, want):
    assert parse_address(text) == want


@pytest.mark.parametrize("text", ["", "host:", "127.0.0.1:99999", "127.0.0.1:http", "a:b:c"])
def test_bad_addresses_name_the_flag(text):
    with pytest.raises(ValueError, match="--http"):
        parse_address(text)


def test_urls_bracket_ipv6():
    assert url("::1", 80) == "http://[::1]:80" and url("10.0.0.1", 80) == "http://10.0.0.1:80"


def test_beyond_loopback_needs_a_key_or_insecure():
    with pytest.raises(ValueError, match="--api-key"):
        CoordinatorConfig(http="0.0.0.0:8000")
    CoordinatorConfig(http="0.0.0.0:8000", api_key="k")
    CoordinatorConfig(http="0.0.0.0:8000", insecure=True)
    CoordinatorConfig(http="127.0.0.1:8000")


def test_the_key_comes_from_a_file_and_stays_out_of_status(tmp_path):
    key = tmp_path / "key"
    key.write_text("s3cret\n")
    args = build_parser().parse_args(["launch", "--http", "0.0.0.0:8000",
                                      "--api-key-file", str(key)])
    config = config_from_args(args)
    assert config.api_key == "s3cret" and "s3cret" not in repr(config)
    with pytest.raises(ValueError, match="not both"):
        config_from_args(build_parser().parse_args(
            ["launch", "--api-key", "a", "--api-key-file", str(key)]))
    with pytest.raises(ValueError, match="non-empty"):
        CoordinatorConfig(api_key=" ")


def test_a_port_in_use_is_named_with_the_flag():
    import socket

    from coordinator.http.address import listen

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"--http 127.0.0.1:{port}: cannot listen .*in use"):
            listen(f"127.0.0.1:{port}")


def test_sse_keepalives_are_off_unless_asked_for_a_positive_number_of_seconds():
    assert config_from_args(build_parser().parse_args(["launch"])).sse_keepalive is None
    args = build_parser().parse_args(["launch", "--sse-keepalive", "15"])
    assert config_from_args(args).sse_keepalive == 15.0
    with pytest.raises(ValueError, match="--sse-keepalive must be a positive"):
        CoordinatorConfig(sse_keepalive=0.0)
