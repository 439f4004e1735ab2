"""Every field of OpenAI's request bodies is implemented, refused with a 400 naming it, or
listed as harmless (accepted, logged once), walked from the `openai` client's own parameter
types; a real `hisparse serve` over a tiny DSA checkpoint answers each (issue #54)."""

from __future__ import annotations

import logging
import typing

import httpx
import pytest

from hisparse import HiSparseConfig
from hisparse.engine.llm import LLM

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from openai.types import completion_create_params as completion_params  # noqa: E402
from openai.types.chat import completion_create_params as chat_params  # noqa: E402

from hisparse.serve import fields  # noqa: E402
from hisparse.serve.background import serve_in_thread  # noqa: E402
from hisparse.serve.protocol import ChatCompletionRequest, CompletionRequest  # noqa: E402

TIMEOUT = 60.0
ROUTES = [
    ("/v1/completions", CompletionRequest, completion_params, {"prompt": "hi"}),
    ("/v1/chat/completions", ChatCompletionRequest, chat_params,
     {"messages": [{"role": "user", "content": "hi"}]}),
]  # fmt: skip


def _openai_fields(module) -> set[str]:
    names = set(typing.get_type_hints(module.CompletionCreateParamsBase))
    return names | set(typing.get_type_hints(module.CompletionCreateParamsStreaming))


def _implemented(model) -> set[str]:
    return {f.alias or name for name, f in model.model_fields.items()}


@pytest.mark.parametrize(("path", "model", "module", "base"), ROUTES)
def test_every_openai_field_is_classified(path, model, module, base):
    known = _implemented(model) | set(model.refused) | fields.HARMLESS
    assert _openai_fields(module) - known == set()
    # nothing is both implemented and refused or harmless
    assert _implemented(model) & (set(model.refused) | fields.HARMLESS) == set()


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    path = tiny_checkpoint("deepseek_v32", tokenizer=True)
    llm = LLM(path, hisparse=HiSparseConfig(host_pool_gib=0.01, block_size=4),
              max_model_len=128, max_num_seqs=2, gpu_memory_gib=0.02, device="cpu")  # fmt: skip
    with serve_in_thread(llm, model_name="tiny") as srv:
        yield srv
    llm.close()


def _post(srv, path, body):
    return httpx.post(srv.url + path, json=body, timeout=TIMEOUT)


@pytest.mark.parametrize(("path", "model", "module", "base"), ROUTES)
def test_refused_fields_are_a_400_naming_them(server, path, model, module, base):
    for name in sorted(model.refused):
        r = _post(server, path, {**base, "max_tokens": 1, name: "a-value-that-does-something"})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == name, (name, err)
        assert err["code"] == "unsupported_field" and name in err["message"]


def test_neutral_harmless_and_unknown_fields_are_accepted(server, caplog):
    neutral = {name: ok[-1] for name, ok in fields.REFUSED_COMPLETIONS.items()}
    harmless = {name: "x" for name in fields.HARMLESS}
    body = {"prompt": "hi", "max_tokens": 2, "temperature": 0, **neutral, **harmless,
            "a_field_nobody_knows": 1}  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="hisparse.serve"):
        r = _post(server, "/v1/completions", body)
        assert r.status_code == 200, r.text
        assert _post(server, "/v1/completions", body).status_code == 200
    logged = [m for m in caplog.messages if "a_field_nobody_knows" in m]
    assert len(logged) == 1 and "ignored" in logged[0]  # once, however many requests
    # the chat route reads them the same way (DeepSeek-V3.2's built-in encoder)
    neutral = {name: ok[-1] for name, ok in fields.REFUSED_CHAT.items()}
    chat = {**ROUTES[1][3], "max_tokens": 2, **neutral, **harmless}
    r = _post(server, "/v1/chat/completions", chat)
    assert r.status_code == 200, r.text
