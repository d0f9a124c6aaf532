"""`siding bench SCENARIO`: each scenario is a module of this package with `main(argv)`.

A scenario's name maps to its module with dashes as underscores (`kv-pipeline` ->
`kv_pipeline.py`). Results land as JSON and a PNG plot under `bench-results/` (see `report.py`).
"""
