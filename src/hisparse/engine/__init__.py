"""The serving engine: requests, scheduler, KV block manager, model runner, sampler, `LLM`."""
