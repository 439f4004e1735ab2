"""HiSparse runtime: per-layer data plane, index groups, the attention-facing cache handle."""
