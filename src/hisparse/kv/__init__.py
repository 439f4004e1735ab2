"""KV cache: row formats, cache specs, host pool, block pools and the layout planner."""
