import pytest

from coordinator.local_cluster import LocalCluster


class Launcher:
    """launch(*args) starts a cluster of real processes. One that a test starts itself stops when
    the test ends; one that a module's fixture starts, when the module ends. So a module's
    clusters do not pile up, each holding its workers' memory, while its later tests run."""

    def __init__(self):
        self.module: list[LocalCluster] = []
        self.test: list[LocalCluster] | None = None  # a test is running: its own clusters

    def __call__(self, *args: str) -> LocalCluster:
        c = LocalCluster(*args, timeout=300)
        (self.module if self.test is None else self.test).append(c)
        c.start()
        return c


@pytest.fixture(scope="module")
def launcher():
    launcher = Launcher()
    yield launcher
    for c in launcher.module:
        c.stop()


@pytest.fixture(autouse=True)
def _stop_a_tests_own_clusters(launcher):
    launcher.test = []  # module fixtures, set up before this one, have started theirs
    yield
    for c in launcher.test:
        c.stop()
    launcher.test = None


@pytest.fixture(scope="module")
def launch(launcher):
    return launcher
