"""A cluster started with CURVE keys serves authorised clients only, workers included."""

import pytest

from protocol import Client, RequestError
from protocol.security import generate_keys


def test_curve_cluster_serves_keyed_clients_and_ignores_others(launch, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys")
    generate_keys(keys)
    cluster = launch("--model", "synthetic:tiny", "--workers", "2", "--curve-keys", str(keys))
    with Client(cluster.endpoint, timeout=60, curve_keys_dir=str(keys)) as c:
        r = c.generate(prompt_token_ids=[5, 6, 7], max_tokens=4, ignore_eos=True)
        assert len(r.token_ids) == 4
    with Client(cluster.endpoint, timeout=2) as c, pytest.raises(RequestError):
        c.generate(prompt_token_ids=[5, 6, 7], max_tokens=4)
