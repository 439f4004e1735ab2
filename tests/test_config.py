"""Configuration limits (docs/design.md §8): each failure names the field and a value that
works."""

import pytest

from hisparse import HiSparseConfig
from hisparse.config import HiSparseConfigError
from hisparse.runtime.sparse_layer import SparseLayerRuntime


def test_defaults_follow_top_k_and_query_len():
    cfg = HiSparseConfig(max_query_len=1).resolve(model_top_k=2048)
    assert cfg.top_k == 2048
    assert cfg.device_buffer_size == 4096
    assert cfg.hot_blocks_per_request == 64
    spec = HiSparseConfig(top_k=2048, max_query_len=3).resolve()
    assert spec.device_buffer_size == 8192


def test_default_buffer_is_capped_at_the_lru_limit():
    cfg = HiSparseConfig(top_k=8192, max_query_len=3).resolve()
    assert cfg.device_buffer_size == 32768


def test_hot_buffer_below_one_steps_rows():
    with pytest.raises(HiSparseConfigError) as e:
        HiSparseConfig(top_k=2048, max_query_len=2, device_buffer_size=3000).resolve()
    msg = str(e.value)
    assert "device_buffer_size=3000" in msg and "device_buffer_size >= 4096" in msg


def test_hot_buffer_above_int16_lru_limit():
    with pytest.raises(HiSparseConfigError) as e:
        HiSparseConfig(top_k=2048, device_buffer_size=40000).resolve()
    msg = str(e.value)
    assert "device_buffer_size=40000" in msg and "= 2048 (one step" in msg and "and 32768" in msg
    assert "Set device_buffer_size <= 32768" in msg


def test_a_top_k_no_hot_buffer_can_hold_names_top_k_and_a_range_that_exists():
    """Not "set device_buffer_size between 99999 and 32768": top_k is what to change."""
    with pytest.raises(HiSparseConfigError) as e:
        HiSparseConfig(top_k=99999).resolve()
    assert e.value.field == "HiSparseConfig.top_k" and e.value.example == 2048
    assert "top_k=99999 must be at most 32768" in str(e.value) and "between" not in str(e.value)


def test_missing_top_k_says_how_to_set_it():
    with pytest.raises(HiSparseConfigError, match="set top_k"):
        HiSparseConfig().resolve()


@pytest.mark.parametrize(
    "field,value",
    [("top_k", 0), ("block_size", -64), ("max_query_len", 1.5), ("top_k", True)],
)
def test_non_positive_integers(field, value):
    with pytest.raises(HiSparseConfigError, match=rf"HiSparseConfig\.{field}=.* positive integer"):
        HiSparseConfig(**{"top_k": 64, field: value}).resolve()


def test_host_pool_gib_must_be_positive():
    with pytest.raises(HiSparseConfigError, match="host_pool_gib=64"):
        HiSparseConfig(top_k=64, host_pool_gib=0).resolve()


def test_row_not_16_byte_aligned():
    cfg = HiSparseConfig(top_k=64).resolve()
    with pytest.raises(HiSparseConfigError) as e:
        SparseLayerRuntime("layers.0.attn", cfg, row_bytes=650, max_num_reqs=1, device="cpu")
    msg = str(e.value)
    assert "layers.0.attn KV row is 650 bytes" in msg and "pad it to 656" in msg


def test_min_host_blocks_counts_null_and_tail():
    cfg = HiSparseConfig(top_k=64, block_size=64).resolve()
    assert cfg.min_host_blocks(131072) == 2048 + 2
    assert cfg.min_host_blocks(100) == 2 + 2
