"""One vocabulary with vLLM (issue #55): every subcommand's flags (one name per setting, its
default shown, its choices listed, old names as warned aliases), the model resolver they
share, ``generate --prompt-file``, and the messages that name the flag and a value that works.
"""

from __future__ import annotations

import argparse
import inspect
import io
import shutil

import pytest

from api_helpers import add_tokenizer
from hisparse import cli_options
from hisparse.cli import build_parser, main
from hisparse.defaults import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS

#: flags whose values are a fixed set: each value must show in the flag's help
ENUMERATED = {
    "--offload": ("always", "under_pressure"),
    "--log-level": ("critical", "error", "warning", "info", "debug", "trace"),
    "--kv-placement": ("hisparse", "gpu"),
    "--kv-format": ("fp8_ds_mla", "bf16"),  # (plan does not take fp32 rows)
    "--dtype": ("float32", "bfloat16", "float16"),
    "--prefill": ("synthetic", "model"),
    "--schedule": ("mixed", "prefill-first"),
    "--target": ("cuda", "cpu"),
}
_FLAGS_ONLY = (
    argparse._HelpAction, argparse._VersionAction, argparse._StoreTrueAction,
    argparse._StoreFalseAction,
)  # fmt: skip


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def test_help_walker_one_name_per_flag_defaults_shown_choices_listed():
    flag_dest: dict[str, str] = {}
    dest_flags: dict[str, set[str]] = {}
    for name, sub in _subcommands().items():
        sub.format_help()  # every help string formats (no stray %)
        fmt = sub._get_formatter()
        for action in sub._actions:
            if action.help == argparse.SUPPRESS:
                assert all(f in cli_options.ALIASES for f in action.option_strings), action
                continue
            if isinstance(action, _FLAGS_ONLY):
                continue
            where = f"hisparse {name} {'/'.join(action.option_strings) or action.metavar}"
            shown = fmt._expand_help(action) + " " + fmt._format_action_invocation(action)
            told = "default" in shown.lower() or "(required" in shown.lower()
            assert action.required or told, f"{where}: no default shown"
            for choice in action.choices or ():
                assert str(choice) in shown, f"{where}: choice {choice} not listed"
            names = action.option_strings
            if isinstance(action, argparse.BooleanOptionalAction):
                names = names[:1]  # --x / --no-x: one flag
            for flag in names:
                assert flag not in cli_options.ALIASES, f"{where}: an old name shown"
                for value in ENUMERATED.get(flag, ()):
                    assert value in shown, f"{where}: {value} not listed"
                if flag.startswith("--"):
                    assert flag_dest.setdefault(flag, action.dest) == action.dest, where
                    dest_flags.setdefault(action.dest, set()).add(flag)
    two = {d: f for d, f in dest_flags.items() if len(f) > 1}
    assert not two, f"one setting under two names: {two}"
    # the renamed knobs everywhere they exist; vLLM's names for vLLM's concepts
    assert {"--sparse-top-k", "--hot-buffer-rows", "--max-num-batched-tokens"} <= set(flag_dest)
    assert "--top-k" not in flag_dest and "--max-batched-tokens" not in flag_dest


def test_one_default_per_setting_from_one_place():
    from hisparse import LLM

    sig = inspect.signature(LLM).parameters
    assert sig["max_num_seqs"].default == DEFAULT_MAX_NUM_SEQS
    assert sig["max_num_batched_tokens"].default == DEFAULT_MAX_NUM_BATCHED_TOKENS
    parser = build_parser()
    gen, srv = parser.parse_args(["generate"]), parser.parse_args(["serve"])
    for args in (gen, srv):
        assert args.max_num_seqs == DEFAULT_MAX_NUM_SEQS
        assert args.max_num_batched_tokens == DEFAULT_MAX_NUM_BATCHED_TOKENS
        assert args.max_model_len is None  # the model's context, as LLM's default
    plan = parser.parse_args(["plan", "--model", "glm-5", "--gpu-memory-gib", "1"])
    assert plan.max_num_batched_tokens == DEFAULT_MAX_NUM_BATCHED_TOKENS


def test_old_flag_names_still_work_and_warn_once(capsys, monkeypatch):
    monkeypatch.setattr(cli_options, "_warned", set())
    parser = build_parser()
    for old, new, value in [("--top-k", "sparse_top_k", "64"),
                            ("--device-buffer-size", "hot_buffer_rows", "128"),
                            ("--max-batched-tokens", "max_num_batched_tokens", "512")]:  # fmt: skip
        args = parser.parse_args(["serve", old, value])
        assert getattr(args, new) == int(value) and args.typed_flags[new] == old
        parser.parse_args(["generate", old, value])
    err = capsys.readouterr().err
    assert err.count("warning: --top-k is now --sparse-top-k") == 1
    assert "SamplingParams.top_k" in err and err.count("is now") == 3
    args = parser.parse_args(["bench", "--model", "m", "--input-len", "1", "--output-len", "2",
                              "--gpu-memory-gib", "1", "--hot-buffer", "64"])  # fmt: skip
    assert args.hot_buffer_rows == 64


def test_version(capsys):
    from hisparse import __version__

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"hisparse {__version__}"


def test_serve_takes_the_model_positionally_as_vllm_does():
    args = build_parser().parse_args(["serve", "smollm2", "--max-num-batched-tokens", "1024"])
    assert cli_options.model_of(args) == "smollm2" and args.max_num_batched_tokens == 1024
    assert cli_options.model_of(build_parser().parse_args(["serve"])) == "smollm2"
    args = build_parser().parse_args(["serve", "a.gguf", "--model", "b.gguf"])
    with pytest.raises(ValueError, match="two models named"):
        cli_options.model_of(args)


# --- messages: the flag, the file, a value that works -----------------------------------------


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (["generate", "--sparse-top-k", "99999", "--model", "MISSING"],
         ["--sparse-top-k 99999: must be at most 32768", "e.g. --sparse-top-k 2048"]),
        (["generate", "--top-k", "99999"], ["--top-k 99999: must be at most 32768"]),
        (["generate", "--sparse-top-k", "4", "--prompt", "hi", "--device", "cpu"],
         ["--sparse-top-k 4: must be >= sink_tokens + recent_window = 68",
          "e.g. --sparse-top-k 256"]),
        (["generate", "--model", "deepseek-v3.2"],
         ["preset of the released model's shapes", "hisparse make-tiny OUT --arch"]),
        (["generate", "--model", "/no/such/folder"],
         ["--model '/no/such/folder': no such file or folder", "'smollm2' (bundled)"]),
        (["bench", "--model", "SmolLM2", "--input-len", "8", "--output-len", "2",
          "--gpu-memory-gib", "1"], ["is a Llama (GQA) model; bench models", "hisparse make-tiny"]),
        (["plan", "--model", "smollm2", "--gpu-memory-gib", "1"], ["DSA) layers only"]),
        (["plan", "--model", "Deepseek-V3.2", "--gpu-memory-gib", "60", "--max-model-len",
          "1000000"], ["--max-model-len 1,000,000: the model's context is 163,840",
                       "give at most --max-model-len 163840"]),
        (["plan", "--model", "glm-5", "--gpu-memory-gib", "60", "--max-model-len", "1",
          "--max-batched-tokens", "0", "--gpu-memory-utilization", "0.5"],
         ["--max-model-len 1: must be at least 2", "--max-batched-tokens 0: must be >= 1",
          "--gpu-memory-utilization 0.5: applies to --gpu-total-gib"]),
        (["plan", "--model", "glm-5", "--gpu-memory-gib", "141", "--tensor-parallel-size", "8"],
         ["with --tensor-parallel-size give each GPU's whole memory", "--gpu-total-gib 141"]),
    ],
)  # fmt: skip
def test_messages_name_the_flag_and_a_value_that_works(capsys, argv, needles):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, err


def test_a_broken_config_json_is_named_with_its_line(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"model_type": "deepseek_v32",\n  "x": }')
    config = str(tmp_path / "config.json")
    for argv in (["generate", "--model", str(tmp_path)],
                 ["plan", "--model", config, "--gpu-memory-gib", "1"]):  # fmt: skip
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"{tmp_path / 'config.json'} is not valid JSON (line 2, column 8" in err, err
    (tmp_path / "config.json").unlink()
    assert main(["generate", "--model", str(tmp_path)]) == 2
    assert "this folder has no config.json, so it is not a checkpoint" in capsys.readouterr().err


# --- generate --prompt-file -------------------------------------------------------------------


@pytest.fixture(scope="module")
def short_context(tmp_path_factory, tiny_checkpoint):
    """A tiny checkpoint whose context (512) is below the old ``generate`` default of 4096,
    with a word-level tokenizer: the default --max-model-len must be the model's."""
    out = tmp_path_factory.mktemp("ctx512")
    shutil.copytree(tiny_checkpoint("deepseek_v32", max_position_embeddings=512), out,
                    dirs_exist_ok=True)  # fmt: skip
    add_tokenizer(out)
    return out


def _answer(out: str) -> str:
    return out.split("Answer:", 1)[1].split("\n", 1)[0].strip()


def test_generate_reads_a_long_prompt_from_a_file_or_stdin(short_context, tmp_path, capsys,
                                                           monkeypatch):  # fmt: skip
    doc = " ".join(f"t{8 + (i * 37) % 500}" for i in range(480))  # 480 words: ~490 tokens
    path = tmp_path / "doc.txt"
    path.write_text(doc)
    base = ["generate", "--model", str(short_context), "--max-tokens", "2", "--device", "cpu",
            "--gpu-memory-gib", "0.02", "--host-pool-gib", "0.01",
            "--max-num-seqs", "1"]  # fmt: skip
    # a prompt of more than one step (--max-num-batched-tokens) shows its prefill progress
    assert main([*base, "--prompt-file", str(path), "--max-num-batched-tokens", "128"]) == 0
    from_file = capsys.readouterr().out
    monkeypatch.setattr("sys.stdin", io.StringIO(doc))
    assert main([*base, "--prompt-file", "-"]) == 0
    from_stdin = capsys.readouterr().out
    assert _answer(from_file) == _answer(from_stdin) != ""
    assert "2 tokens" in from_stdin
    # longer than the model's context: refused before anything runs, saying what to do
    path.write_text(doc + " t9" * 40)
    assert main([*base, "--prompt-file", str(path)]) == 2
    err = capsys.readouterr().err
    assert "max_model_len=512 (the --max-model-len flag) leaves room for at most 511" in err
    assert "shorten the prompt" in err and "Answer" not in err


def test_generate_a_7500_token_document_on_smollm2_from_a_file_and_from_stdin(tmp_path):
    """The issue's case as a user runs it (real processes, the real SmolLM2 weights and
    tokenizer, HiSparse's default top-k): ``hisparse generate --prompt-file doc.txt`` with a
    ~7,500-token document of real text (the Python reference shipped with Python) under the
    default --max-model-len (the model's 8,192; the old 4,096 refused it), and ``cat
    doc.txt | hisparse generate --prompt-file -`` against ``--prompt-file`` with the same
    text: the same answer. The 7,500-token prefill costs about a minute of one core (docs/
    benchmarks.md §25), so the stdin pair reads the document's first ~1,000 tokens; the three
    run at once, one thread each."""
    import os
    import re
    import subprocess
    import sys
    from pydoc_data.topics import topics

    from hisparse.models.smollm2 import smollm2_gguf_path

    smollm2_gguf_path()  # installed (hisparse[smollm2]): say so here, not in three processes
    text = "\n\n".join(topics[k].strip() for k in sorted(topics))
    ask = "\n\nSummarize this document in one sentence."
    long_doc, short_doc = tmp_path / "doc.txt", tmp_path / "short.txt"
    long_doc.write_text(text[: text.rfind("\n\n", 0, 32_000)] + ask, encoding="utf-8")
    short_doc.write_text(text[: text.rfind("\n\n", 0, 4_200)] + ask, encoding="utf-8")
    cmd = [sys.executable, "-m", "hisparse", "generate", "--max-tokens", "3", "--device", "cpu"]
    # a user's environment, one thread each on a 2-core machine: without the suite's
    # HISPARSE_POISON (its NaN fill commits every process's whole 1 GiB CPU "GPU" pool)
    env = {k: v for k, v in os.environ.items() if k != "HISPARSE_POISON"}
    env["OMP_NUM_THREADS"] = "1"
    pipe = subprocess.PIPE
    with short_doc.open("rb") as cat:  # ``cat short.txt |``: the document on stdin
        runs = [
            subprocess.Popen([*cmd, "--prompt-file", str(f)], stdout=pipe, stderr=pipe, env=env)
            for f in (long_doc, short_doc)
        ]
        runs.append(subprocess.Popen([*cmd, "--prompt-file", "-"], stdin=cat, stdout=pipe,
                                     stderr=pipe, env=env))  # fmt: skip
        outs = [p.communicate(timeout=900) for p in runs]
    for p, (_, err) in zip(runs, outs, strict=True):
        assert p.returncode == 0, err.decode()
    texts = long_out, from_file, from_stdin = [o.decode() for o, _ in outs]
    # the summary line counts the prompt and the 3 new tokens
    lens = [int(re.search(r"rows/layer for (\d+) tokens", o).group(1)) - 3 for o in texts]
    assert 7_400 <= lens[0] <= 7_600 and 900 <= lens[1] == lens[2] <= 1_100, lens
    assert _answer(long_out) != "", long_out
    assert _answer(from_file) == _answer(from_stdin) != "", (from_file, from_stdin)


@pytest.mark.parametrize(
    ("setup", "needle"),
    [("missing", "--prompt-file {p}: no such file"), ("folder", "is a folder"),
     ("empty", "the prompt is empty"), ("binary", "not UTF-8 text")],
)  # fmt: skip
def test_prompt_file_errors_name_the_file(tmp_path, capsys, setup, needle):
    path = tmp_path / "doc.txt"
    if setup == "folder":
        path.mkdir()
    elif setup == "empty":
        path.write_text("  \n")
    elif setup == "binary":
        path.write_bytes(b"\xff\xfe\x00 text")
    assert main(["generate", "--prompt-file", str(path)]) == 2
    assert needle.format(p=path) in capsys.readouterr().err


# --- serve MODEL and hisparse chat, as a vLLM user runs them ---------------------------------


def test_serve_smollm2_positionally_with_vllm_flags_and_chat_with_it(capsys):
    """``hisparse serve smollm2 --max-num-batched-tokens 1024`` (a real server process), then
    ``hisparse chat --quick`` and the openai client with logprobs against it."""
    import queue
    import re
    import subprocess
    import sys
    import threading

    openai = pytest.importorskip("openai")
    smollm2 = pytest.importorskip("hisparse.models.smollm2")
    smollm2.smollm2_gguf_path()
    cmd = [sys.executable, "-m", "hisparse", "serve", "smollm2", "--max-num-batched-tokens",
           "1024", "--port", "0", "--device", "cpu", "--max-model-len", "512", "--max-num-seqs",
           "2", "--gpu-memory-gib", "0.25", "--host-pool-gib", "0.25",
           "--log-level", "warning"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
        port = None
        while port is None:
            assert proc.poll() is None, proc.stderr.read()
            m = re.search(r"serving smollm2 on http://127\.0\.0\.1:(\d+)/v1 .*up to 2 running",
                          lines.get(timeout=240))  # fmt: skip
            port = m and int(m.group(1))
        url = f"http://127.0.0.1:{port}/v1"
        ask = ["chat", "--url", url, "--quick", "What is the capital of France?",
               "--max-tokens", "8", "--temperature", "0"]  # fmt: skip
        assert main(ask) == 0
        assert "Paris" in capsys.readouterr().out
        client = openai.OpenAI(base_url=url, api_key="EMPTY", max_retries=0, timeout=120)
        r = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
            temperature=0, logprobs=True, top_logprobs=2,
        )  # fmt: skip
        first = r.choices[0].logprobs.content[0]
        assert isinstance(first.logprob, float) and len(first.top_logprobs) == 2
    finally:
        proc.kill()
        proc.wait(timeout=30)
    bad = ["chat", "--url", f"http://127.0.0.1:{port}/v1", "--quick", "hi"]
    assert main(bad) == 1
    assert "no server at --url" in capsys.readouterr().err


# --- the Python API as vLLM code uses it ------------------------------------------------------


def test_vllm_style_api_usage(short_context):
    from hisparse import LLM, HiSparseConfig, SamplingParams

    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0\.5 must be None when"):
        LLM(short_context, gpu_memory_gib=1, gpu_memory_utilization=0.5)
    with pytest.raises(ValueError, match=r"SamplingParams.min_p=1.5 must be a finite number in"):
        SamplingParams(min_p=1.5)
    small = HiSparseConfig(host_pool_gib=0.01, block_size=4)
    llm = LLM(short_context, gpu_memory_utilization=0.001, max_model_len=256, max_num_seqs=2,
              hisparse=small, device="cpu")  # fmt: skip
    with llm:
        tok = llm.get_tokenizer()
        ids = tok.encode("t10 t11 t12", add_special_tokens=False)
        assert ids == [10, 11, 12] and tok.decode(ids) == "t10 t11 t12"
        assert tok.apply_chat_template([{"role": "user", "content": "t9"}]).endswith("t2 t5 ")
        prompt = "t10 t11 t12 t13"
        greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        (base,) = llm.generate([prompt], greedy, use_tqdm=False)
        # min_p=1 keeps only the most likely token: sampling then picks the greedy one
        minp = SamplingParams(temperature=1.0, min_p=1.0, seed=3, max_tokens=6, ignore_eos=True)
        assert llm.generate(prompt, minp, use_tqdm=False)[0].token_ids == base.token_ids
        # logprobs are vLLM's Logprob objects (and still numbers)
        lp = SamplingParams(temperature=0, max_tokens=3, logprobs=2, ignore_eos=True)
        (out,) = llm.generate(prompt, lp)
        total = 0.0
        for token, step in zip(out.token_ids, out.outputs[0].logprobs, strict=True):
            chosen = step[token]
            assert chosen.rank == 1 and chosen.logprob <= 0 and chosen == chosen.logprob
            assert chosen.decoded_token == tok.decode([token])
            assert sorted(v.rank for v in step.values()) == [1, 2]
            total += chosen.logprob
        assert out.outputs[0].cumulative_logprob == pytest.approx(total)
        # a stop string cut before it, or kept with include_stop_str_in_output
        word = base.text.split()[2]
        at = base.text.find(word)
        for keep in (False, True):
            p = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, stop=[word],
                               include_stop_str_in_output=keep)  # fmt: skip
            (cut,) = llm.generate(prompt, p)
            assert cut.text == base.text[: at + len(word) * keep] and cut.finish_reason == "stop"
        # a prompt the engine can never run raises, as vLLM's does; roles as the server's
        with pytest.raises(ValueError, match="max_model_len=256"):
            llm.generate(prompt_token_ids=[10] * 300)
        with pytest.raises(ValueError, match=r"\['role'\]='wizard' must be one of"):
            llm.chat([{"role": "wizard", "content": "t9"}])
