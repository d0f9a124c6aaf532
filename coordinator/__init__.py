"""siding's coordinator: scheduling, paged KV bookkeeping, workers, and the CLI."""
