"""Helpers shared by the public-API tests (``tests/test_api_*.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from hisparse import LLM, HiSparseConfig

#: Small pools and lengths: a tiny DSA engine builds in a fraction of a second.
TINY_LLM = dict(
    hisparse=HiSparseConfig(host_pool_gib=0.01, block_size=4),
    max_model_len=128,
    max_num_seqs=4,
    gpu_memory_gib=0.02,
)
#: A chat template in the Hugging Face style (role markers, a generation prompt, and
#: ``raise_exception`` for a role it does not know).
CHAT_TEMPLATE = (
    "{% set roles = {'user': 't4', 'assistant': 't5', 'system': 't6'} %}{{ bos_token }} "
    "{% for m in messages %}{% if m['role'] not in roles %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "t2 {{ roles[m['role']] }} {{ m['content'] }} t3 {% endfor %}"
    "{% if add_generation_prompt %}t2 t5 {% endif %}"
)


def add_tokenizer(folder: Path, vocab_size: int = 512) -> None:
    """A word-level tokenizer.json (words ``t0`` .. ``t{V-1}``, anything else ``t7``) and a
    tokenizer_config.json with `CHAT_TEMPLATE`, beside a tiny checkpoint that has none."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t7"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece()  # words joined by spaces
    tk.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "t0", "eos_token": "t1", "chat_template": CHAT_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def prompts(lengths, seed=1, vocab=512) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(8, vocab, (n,), generator=g).tolist() for n in lengths]


def tiny_llm(path, **kw) -> LLM:
    return LLM(path, **{**TINY_LLM, **kw})


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")
