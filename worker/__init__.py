"""The worker: a contiguous range of the model's layers, its KV pool, and the step loop."""
