"""A model's cache shape read from its config.json: the indexer layers, row sizes, IndexShare
leaders and the refusals (`hisparse.kv.cache_shapes`)."""

from __future__ import annotations

import json

import pytest

from hisparse.config import HiSparseConfigError
from hisparse.kv.cache_shapes import cache_shape_from_hf_config, load_model_cache_shape


def test_config_json_glm_moe_dsa(tmp_path):
    cfg = {
        "model_type": "glm_moe_dsa",
        "num_hidden_layers": 6,
        "kv_lora_rank": 256,
        "qk_rope_head_dim": 64,
        "index_topk": 512,
        "index_head_dim": 64,
        "index_topk_freq": 2,
        "index_skip_topk_offset": 2,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    shape = cache_shape_from_hf_config(path, kv_format="bf16")
    assert shape.index_topk == 512 and shape.num_layers == 6
    assert [s.name for s in shape.indexer_specs] == [
        "layers.0.indexer", "layers.1.indexer", "layers.3.indexer", "layers.5.indexer",
    ]  # fmt: skip
    assert {s.row_bytes for s in shape.indexer_specs} == {68}
    assert {s.row_bytes for s in shape.sparse_specs} == {2 * (256 + 64)}
    assert shape.sparse_specs[2].index_leader == "layers.1.attn"
    # a model folder works too, and the explicit pattern overrides freq/offset
    cfg["index_topk_pattern"] = "FSSSSF"
    path.write_text(json.dumps(cfg))
    shape = load_model_cache_shape(str(tmp_path))
    assert [s.name for s in shape.indexer_specs] == ["layers.0.indexer", "layers.5.indexer"]
    assert shape.sparse_specs[4].index_leader == "layers.0.attn"
    assert {s.row_bytes for s in shape.sparse_specs} == {656 - 256 - 4 * 2}  # 256 + 8 + 128


def test_config_json_deepseek_v32_and_defaults(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "deepseek_v32", "num_hidden_layers": 3}))
    shape = load_model_cache_shape(path)
    assert shape.num_layers == 3 and shape.index_topk == 2048
    assert [s.name for s in shape.specs] == [
        "layers.0.attn", "layers.0.indexer", "layers.1.attn", "layers.1.indexer",
        "layers.2.attn", "layers.2.indexer",
    ]  # fmt: skip
    assert shape.specs[0].row_bytes == 656 and shape.specs[1].row_bytes == 132


def test_config_json_unsupported_model_type(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 30}))
    with pytest.raises(HiSparseConfigError) as err:
        load_model_cache_shape(path)
    assert "'llama' is not supported" in str(err.value)
    assert "deepseek_v32 or glm_moe_dsa" in str(err.value)
    with pytest.raises(HiSparseConfigError, match="neither a preset"):
        load_model_cache_shape(tmp_path / "missing.json")
    with pytest.raises(HiSparseConfigError, match="use one of fp8_ds_mla, bf16"):
        load_model_cache_shape("deepseek-v3.2", kv_format="fp16")
