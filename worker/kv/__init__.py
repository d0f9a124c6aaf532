"""The worker's KV: the pool interface (`pool.py`), its device and host pools, the staging ring
and transports beneath the host pool, the park store beside them, and the one function that
writes a step's rows into pages (`rows.py`)."""
