import pytest

from coordinator.local_cluster import LocalCluster


@pytest.fixture(scope="module")
def launch():
    """launch(*args) starts a cluster of real processes; all stop when the module ends."""
    clusters = []

    def start(*args: str) -> LocalCluster:
        c = LocalCluster(*args, timeout=300)
        c.start()
        clusters.append(c)
        return c

    yield start
    for c in clusters:
        c.stop()
