"""DSA models (DeepSeek-V3.2, GLM-5): configuration, network, cache access, loading."""

from hisparse.models.deepseek_v32 import DsaForCausalLM
from hisparse.models.dsa_config import DsaConfig, DsaConfigError
from hisparse.models.kv_access import (
    DenseDsaCache,
    DsaKVCache,
    ForwardStep,
    IndexerLayerCache,
    SparseMlaLayerCache,
)
from hisparse.models.loader import CheckpointError, load_dsa_model

__all__ = [
    "CheckpointError",
    "DenseDsaCache",
    "DsaConfig",
    "DsaConfigError",
    "DsaForCausalLM",
    "DsaKVCache",
    "ForwardStep",
    "IndexerLayerCache",
    "SparseMlaLayerCache",
    "load_dsa_model",
]
