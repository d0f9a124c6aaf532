"""A cluster started with CURVE keys serves authorised clients only, workers included."""

import subprocess
import sys

import pytest

from protocol import Client, RequestError
from protocol.security import generate_keys


def siding(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "coordinator", *args], capture_output=True,
                          text=True, timeout=120)


def test_curve_cluster_serves_keyed_clients_and_tells_others_of_the_keys(launch, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys")
    generate_keys(keys)
    cluster = launch("--model", "synthetic:tiny", "--workers", "2", "--curve-keys", str(keys))
    with Client(cluster.endpoint, timeout=60, curve_keys_dir=str(keys)) as c:
        r = c.generate(prompt_token_ids=[5, 6, 7], max_tokens=4, ignore_eos=True)
        assert len(r.token_ids) == 4
    with Client(cluster.endpoint, timeout=2) as c, pytest.raises(
            RequestError, match="not this client's handshake: it may require CURVE keys"):
        c.generate(prompt_token_ids=[5, 6, 7], max_tokens=4)
    keyless = siding("status", "--endpoint", cluster.endpoint, "--timeout", "1")
    assert keyless.returncode == 1 and "give --curve-keys DIR" in keyless.stderr, keyless.stderr
    keyed = siding("status", "--endpoint", cluster.endpoint, "--curve-keys", str(keys))
    assert keyed.returncode == 0 and "synthetic:tiny" in keyed.stdout, keyed.stderr
