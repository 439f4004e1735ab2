"""DeepSeek-V4 through the engine (all-GPU placement, on the CPU): `hisparse.LLM` with chunked
prefill mixed with decodes gives transformers' greedy tokens; `hisparse generate` and the
server (`make_server`, what `hisparse serve` runs) answer real text through the `openai`
client; what is not built yet (HiSparse placement under tensor parallelism, data parallelism)
is refused clearly. HiSparse placement: `test_engine_v4_hisparse.py`."""

from __future__ import annotations

import threading
import time

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hisparse import LLM, HiSparseConfig, SamplingParams  # noqa: E402
from hisparse.config import HiSparseConfigError  # noqa: E402

LENGTHS = (20, 37, 9)
NEW = 10


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint("deepseek_v4")


@pytest.fixture(scope="module")
def llm(ckpt):
    # 16 tokens a step: the 37-token prompt runs in three chunks (ends inside CSA and HCA
    # windows), beside the other requests' decodes
    engine = LLM(ckpt, kv_placement="gpu", max_num_seqs=4, max_model_len=128,
                 max_num_batched_tokens=16, device="cpu")  # fmt: skip
    yield engine
    engine.close()


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_greedy_tokens_equal_transformers(ckpt, llm, backend, monkeypatch):
    """Both attention backends (the Triton kernel under the interpreter on the CPU)."""
    monkeypatch.setenv("HISPARSE_ATTENTION", backend)
    g = torch.Generator().manual_seed(5)
    # the interpreted kernel: one prompt past the window and two CSA entries, 4 tokens
    lengths, new = (LENGTHS, NEW) if backend == "reference" else ((20,), 4)
    prompts = [torch.randint(2, 512, (n,), generator=g).tolist() for n in lengths]
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.outputs[0].token_ids for o in outs] == _reference_tokens(ckpt, prompts, new)


def _reference_tokens(ckpt, prompts: list[list[int]], new: int = NEW) -> list[list[int]]:
    ref = transformers.DeepseekV4ForCausalLM.from_pretrained(ckpt).eval()
    out = []
    for prompt in prompts:
        with torch.no_grad():
            want = ref.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False,
                                min_new_tokens=new)  # fmt: skip
        out.append(want[0, len(prompt) :].tolist())
    return out


def test_fixed_shape_decode_equals_transformers(ckpt):
    """``cuda_graphs=True`` on the CPU: the CUDA graphs' fixed-shape decode step (padded
    batch, sync-free compressor and MoE) run eagerly."""
    g = torch.Generator().manual_seed(6)
    # three requests: decode batches padded to 4 (a padding row to the spare slot)
    prompts = [torch.randint(2, 512, (n,), generator=g).tolist() for n in LENGTHS]
    engine = LLM(ckpt, kv_placement="gpu", max_num_seqs=4, max_model_len=64, device="cpu",
                 cuda_graphs=True, max_num_batched_tokens=16)  # fmt: skip
    try:
        assert engine.runner.decode_path == "padded"
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        outs = engine.generate(prompt_token_ids=prompts, sampling_params=params)
    finally:
        engine.close()
    assert [o.outputs[0].token_ids for o in outs] == _reference_tokens(ckpt, prompts, 6)


def test_preemption_recomputes_the_carried_state(ckpt):
    """A pool of 12 usable blocks of 8 tokens for 4 requests of up to 53: one is preempted and
    recomputed (its slot's compressor state rebuilt from position 0); tokens unchanged."""
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(2, 512, (n,), generator=g).tolist() for n in (30, 41, 25, 36)]
    row_bytes = 1024  # the tiny preset's four layers' rows in fp32 (HCA, CSA, sliding, CSA)
    engine = LLM(ckpt, kv_placement="gpu", device="cpu", max_num_seqs=4, max_model_len=64,
                 gpu_memory_gib=13 * 8 * row_bytes / 2**30, max_num_batched_tokens=32,
                 hisparse=HiSparseConfig(block_size=8))  # fmt: skip
    try:
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        outs = engine.generate(prompt_token_ids=prompts, sampling_params=params)
    finally:
        engine.close()
    assert sum(o.metrics.preemptions for o in outs) > 0
    assert [o.outputs[0].token_ids for o in outs] == _reference_tokens(ckpt, prompts, 12)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(kv_placement="hisparse", tensor_parallel_size=2), "LLM.kv_placement"),
        (dict(kv_placement="gpu", kv_format="fp8_ds_mla"), "LLM.kv_format"),
        (dict(kv_placement="gpu", tensor_parallel_size=3), "LLM.tensor_parallel_size"),
        (dict(kv_placement="gpu", data_parallel_size=2), "LLM.data_parallel_size"),
    ],
)
def test_what_is_not_built_is_refused(ckpt, kwargs, field):
    with pytest.raises(HiSparseConfigError, match=field) as err:
        LLM(ckpt, device="cpu", **kwargs)
    assert err.value.field == field


def test_tensor_parallel_2_equals_transformers(ckpt, monkeypatch):
    """Two ranks (gloo on the CPU): heads, output groups and expert widths split, one
    all-reduce after the attention and one after the MoE; rank 0 samples."""
    monkeypatch.setenv("HISPARSE_TP_TIMEOUT", "60")  # a hang fails in 60 s
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(2, 512, (n,), generator=g).tolist() for n in (37, 12)]
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    with LLM(ckpt, kv_placement="gpu", tensor_parallel_size=2, max_num_seqs=2, max_model_len=64,
             max_num_batched_tokens=16, gpu_memory_gib=0.02) as llm:  # fmt: skip
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.outputs[0].token_ids for o in outs] == _reference_tokens(ckpt, prompts)


def _quantized(ckpt, out):
    """``ckpt`` with ``wq_b`` in fp8 (UE8M0 tiles) and the routed experts' ``w1`` / ``w3`` in
    4-bit (the release's formats; rows a rank splits mid-tile included)."""
    import shutil

    from safetensors.torch import load_file, save_file

    tensors = load_file(ckpt / "model.safetensors")
    g = torch.Generator().manual_seed(3)
    for name in list(tensors):
        base = name[: -len("weight")]
        if name.endswith("attn.wq_b.weight") and ".indexer." not in name:
            n, k = tensors[name].shape
            tensors[name] = (tensors[name] * 64).to(torch.float8_e4m3fn)
            tensors[base + "scale"] = torch.full(
                (-(-n // 128), -(-k // 128)), 121, dtype=torch.uint8
            )
        elif ".experts." in name and name.endswith(("w1.weight", "w3.weight")):
            n, k = tensors[name].shape
            tensors[name] = torch.randint(-128, 128, (n, k // 2), generator=g).to(torch.int8)
            tensors[base + "scale"] = torch.randint(118, 122, (n, k // 32), generator=g).to(
                torch.uint8
            )
    out.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(ckpt / name, out / name)
    save_file(tensors, out / "model.safetensors")
    return out


def test_tensor_parallel_2_of_quantized_layers(ckpt, tmp_path, monkeypatch):
    """fp8 and 4-bit layers split with their scales (a rank's fp8 rows starting inside a
    tile): two ranks give the greedy tokens of the one-process forward."""
    from hisparse.models.v4_loader import load_v4_model

    monkeypatch.setenv("HISPARSE_TP_TIMEOUT", "60")
    path = _quantized(ckpt, tmp_path / "q")
    g = torch.Generator().manual_seed(8)
    prompt = torch.randint(2, 512, (23,), generator=g).tolist()
    model, want = load_v4_model(path), []
    for _ in range(6):
        want.append(int(model.prefill_logits([prompt + want])[0][-1].argmax()))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with LLM(path, kv_placement="gpu", tensor_parallel_size=2, max_num_seqs=2, max_model_len=64,
             gpu_memory_gib=0.02) as llm:  # fmt: skip
        out = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
    assert out.outputs[0].token_ids == want


def test_what_a_rank_reads(ckpt):
    """Rank 1 of 2 reads its half of the split tensors only; the indexer, compressors, KV head
    and router are read whole (`shard_v4`'s splits)."""
    from types import SimpleNamespace

    from hisparse.models.deepseek_v4 import DeepseekV4ForCausalLM
    from hisparse.models.v4_config import V4Config
    from hisparse.parallel.shard_v4 import shard_v4

    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(V4Config.from_pretrained(ckpt))
    splits = shard_v4(model, SimpleNamespace(rank=1, world_size=2, all_reduce=None))
    d, r = 32, 16  # head_dim, o_lora_rank: 4 heads in 2 groups, moe width 32
    assert splits["layers.0.attn.wq_b.weight"] == (0, 2 * d, 2 * d)
    assert splits["layers.0.attn.attn_sink"] == (0, 2, 2)
    assert splits["layers.0.attn.wo_a.weight"] == (0, r, r)
    assert splits["layers.0.attn.wo_b.weight"] == (1, r, r)
    assert splits["layers.0.ffn.experts.7.w2.weight"] == (1, 16, 16)
    assert splits["layers.0.ffn.shared_experts.w3.weight"] == (0, 16, 16)
    for whole in ("layers.1.attn.indexer.wq_b.weight", "layers.1.attn.wkv.weight",
                  "layers.1.attn.compressor.wkv.weight", "layers.1.ffn.gate.weight",
                  "layers.1.attn.wq_a.weight", "embed.weight", "head.weight"):  # fmt: skip
        assert whole not in splits
    assert model.layers[0].attn.n_heads == 2 and model.layers[0].attn.groups == 1


def test_generate_cli(ckpt, capsys):
    from hisparse.cli import main

    argv = ["generate", "--model", str(ckpt), "--prompt", "Hello there", "--max-tokens", "6",
            "--kv-placement", "gpu", "--device", "cpu", "--max-model-len", "256"]  # fmt: skip
    assert main(argv) == 0
    assert "6 tokens" in capsys.readouterr().out


def test_server_answers_through_openai(ckpt, llm):
    openai = pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    import socket

    from hisparse.serve.server import make_server

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv, state = make_server(llm, model_name="v4-tiny", host="127.0.0.1", port=port)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not srv.started:
        assert time.monotonic() < deadline, "the server did not start within 60 s"
        time.sleep(0.05)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                               timeout=120, max_retries=0)  # fmt: skip
        prompt = "The quick brown fox jumps over the lazy dog. " * 2
        plain = client.completions.create(model="v4-tiny", prompt=prompt, max_tokens=8,
                                          temperature=0)  # fmt: skip
        chunks = list(client.completions.create(model="v4-tiny", prompt=prompt, max_tokens=8,
                                                temperature=0, stream=True))  # fmt: skip
        assert plain.choices[0].text == "".join(c.choices[0].text for c in chunks if c.choices)
        assert plain.usage.completion_tokens == 8 or plain.choices[0].finish_reason == "stop"
        direct = llm.tokenizer.encode(prompt)
        assert plain.usage.prompt_tokens == len(direct)
    finally:
        srv.should_exit = True
        thread.join(30)
        state.engine.shutdown()
