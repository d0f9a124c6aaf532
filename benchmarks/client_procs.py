"""How many client processes a bench's load takes, and whether they were what limited it.

A client process is one Python thread running asyncio streams (`serve_load.py`): it reads about
10-13k chunks a second through siding's `AsyncClient`, and the `openai` client costs some
200-250 us of CPU a token, 4-5k tokens a second. A GPU cluster streamed 150-500 tokens a second
to each stream at 1-32 streams (docs/benchmarks.md, H200), so 8 streams keep a process under a
core through either API.
"""

from __future__ import annotations

from typing import Any

STREAMS_PER_CLIENT = 8
SATURATED = 0.9  # cores a client process keeps busy when its one Python thread has none to spare


def auto_client_procs(streams: int, cluster_procs: int, cores: int) -> int:
    """One client process per STREAMS_PER_CLIENT streams, on the `cores` this bench may use less
    a core for each of the cluster's `cluster_procs` processes (engine core, frontends,
    workers); at least one."""
    return max(1, min(-(-streams // STREAMS_PER_CLIENT), cores - cluster_procs))


def client_limit(cpu: list[dict[str, Any]], procs: int, streams: int) -> str | None:
    """Why the bench's own client processes (`cpu`'s "bench client" entries, as
    `proc_cpu.cpu_use` gives them) limited the point, and what to do; None when none was
    saturated."""
    busy = [c["cores"] for c in cpu if c["name"].startswith("bench client")
            and c["cores"] is not None]
    if not busy or max(busy) <= SATURATED:
        return None
    more = min(streams, 2 * procs)
    advice = (f"rerun with --client-procs {more}" if more > procs
              else "each stream has a process already; give the clients more cores")
    return (f"a client process kept {max(busy):.2f} cores busy ({procs} for {streams} "
            f"streams): the bench's clients, not the cluster, set this rate; {advice}")
