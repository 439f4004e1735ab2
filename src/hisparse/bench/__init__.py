"""Benchmark-only parts: top-k replay, synthetic prefill, swap-in timing (plugged into the
engine through `hisparse.engine.hooks.StepHooks`), the `hisparse bench` command and its
prefill-rate count."""
