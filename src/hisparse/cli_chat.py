"""``hisparse chat``: an interactive chat with a running ``hisparse serve`` (vLLM's
``vllm chat``), through the OpenAI client.

Each line typed is a user message; the answer streams back, and the conversation so far goes
with every request. ``--quick MESSAGE`` sends one message, prints the answer and exits (for
scripts). An empty line, end of input (Ctrl-D) or Ctrl-C ends the chat. The model defaults to
the first one the server lists.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from hisparse.defaults import DEFAULT_HOST, DEFAULT_PORT

#: Exit status when the server cannot be reached or refuses a request.
EXIT_FAILURE = 1


def add_chat_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "chat",
        help="chat with a running hisparse serve (OpenAI API)",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
    )
    p.add_argument(
        "--url",
        default=f"http://{DEFAULT_HOST}:{DEFAULT_PORT}/v1",
        help="the server's OpenAI API base URL (default: %(default)s)",
    )
    p.add_argument(
        "--model-name", default=None, help="the model to ask (default: the server's first)"
    )
    p.add_argument(
        "--api-key", default=None, help="the server's --api-key (default: none, open server)"
    )
    p.add_argument("--system-prompt", default=None, help="a system message first (default: none)")
    p.add_argument(
        "-q", "--quick", metavar="MESSAGE", default=None,
        help="send this one message, print the answer and exit (default: interactive)",
    )  # fmt: skip
    p.add_argument(
        "--max-tokens", type=int, default=None,
        help="most tokens per answer (default: the server's, up to max_model_len)",
    )  # fmt: skip
    p.add_argument(
        "--temperature", type=float, default=None, help="sampling temperature (default: 1.0)"
    )
    p.set_defaults(handler=run_chat)


def _client(args: argparse.Namespace) -> tuple[Any, Any]:
    """(the openai module, a client of ``--url``)."""
    try:
        import openai
    except ImportError:
        raise ValueError(
            "hisparse chat needs the openai package: pip install 'hisparse[chat]'"
        ) from None
    key = args.api_key or "EMPTY"
    return openai, openai.OpenAI(base_url=args.url, api_key=key, max_retries=0)


def run_chat(args: argparse.Namespace) -> int:
    openai, client = _client(args)
    try:
        model = args.model_name or client.models.list().data[0].id
    except openai.APIConnectionError:
        print(
            f"hisparse chat: error: no server at --url {args.url}; start one with "
            "hisparse serve (or give its --url)",
            file=sys.stderr,
        )
        return EXIT_FAILURE
    except openai.APIStatusError as err:
        print(f"hisparse chat: error: {args.url}: {err.message}", file=sys.stderr)
        return EXIT_FAILURE
    messages: list[dict[str, str]] = []
    if args.system_prompt:
        messages.append({"role": "system", "content": args.system_prompt})
    sampling = {k: v for k, v in (("max_tokens", args.max_tokens),
                                  ("temperature", args.temperature)) if v is not None}  # fmt: skip
    interactive = args.quick is None
    if interactive:
        print(f"chatting with {model} at {args.url}; an empty line or Ctrl-D ends it", flush=True)
    try:
        while True:
            text = args.quick if not interactive else _read("> ")
            if not text:
                return 0
            messages.append({"role": "user", "content": text})
            try:
                answer = _stream(client, model, messages, sampling)
            except openai.APIStatusError as err:
                print(f"hisparse chat: error: {err.message}", file=sys.stderr)
                messages.pop()
                if not interactive:
                    return EXIT_FAILURE
                continue
            messages.append({"role": "assistant", "content": answer})
            if not interactive:
                return 0
    except KeyboardInterrupt:
        print()
        return 0


def _read(prompt: str) -> str | None:
    try:
        return input(prompt).strip()
    except EOFError:
        return None


def _stream(client: Any, model: str, messages: list[dict[str, str]], sampling: dict) -> str:
    """Stream one answer to stdout as it comes; the whole answer."""
    parts = []
    stream = client.chat.completions.create(model=model, messages=messages, stream=True, **sampling)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
            print(parts[-1], end="", flush=True)
    print(flush=True)
    return "".join(parts)
