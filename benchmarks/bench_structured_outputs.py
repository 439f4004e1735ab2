"""What a structured output's token mask costs: SmolLM2 on the CPU, greedy chat answers at
batch 1 and 16, decoded free and under a JSON schema (`SamplingParams.structured_outputs`).

For each batch the free run and the schema run answer the same prompts, free first; the
schema is compiled before timing (its compile time is printed apart). Reported: output
tokens per second of `LLM.chat` (prefill included, the same prompts both ways) and the time
of the mask itself per engine step (`grammar.apply_grammar_masks`: the host's bitmask fill for
every grammar row, the copy, the unpack and the ``-inf`` fill), wall and process CPU time.

    PYTHONPATH=src python benchmarks/bench_structured_outputs.py [--max-tokens 48]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from hisparse import LLM, SamplingParams
from hisparse.engine import grammar  # the sampler imports its mask at call time
from hisparse.engine.structured_params import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer"},
        "city": {"type": "string", "maxLength": 24},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 24}},
    },
    "required": ["name", "age", "city", "hobbies"],
}
NAMES = ["Ada", "Bob", "Chen", "Dara", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun", "Kai", "Lea",
         "Max", "Nia", "Oto", "Pia"]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    args = ap.parse_args()
    llm = LLM("smollm2", device="cpu", max_model_len=1024, max_num_seqs=max(args.batches),
              gpu_memory_gib=0.5)  # fmt: skip
    spec = StructuredOutputsParams(json=SCHEMA)
    t = time.perf_counter()
    llm.grammars.compile(spec)
    print(f"schema compiled in {time.perf_counter() - t:.2f} s (vocabulary and grammar)")
    mask_wall: list[float] = []
    mask_cpu: list[float] = []
    inner = grammar.apply_grammar_masks

    def timed(*a, **kw):
        w, c = time.perf_counter(), time.process_time()
        inner(*a, **kw)
        mask_wall.append(time.perf_counter() - w)
        mask_cpu.append(time.process_time() - c)

    grammar.apply_grammar_masks = timed
    rows = []
    for b in args.batches:
        convs = [[{"role": "user", "content": f"Describe {n}, a person, as JSON."}]
                 for n in NAMES[:b]]  # fmt: skip
        llm.chat(convs[:1], SamplingParams(temperature=0, max_tokens=2))  # warm-up
        for label, so in (("free", None), ("json schema", spec)):
            mask_wall.clear()
            mask_cpu.clear()
            params = SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                    structured_outputs=so)  # fmt: skip
            t = time.perf_counter()
            outs = llm.chat(convs, params)
            dt = time.perf_counter() - t
            n = sum(len(o.token_ids) for o in outs)
            ok = sum(_parses(o.text) for o in outs) if so else None
            mw = statistics.median(mask_wall) * 1e3 if mask_wall else None
            mc = statistics.median(mask_cpu) * 1e3 if mask_cpu else None
            rows.append((b, label, n, n / dt, mw, mc, ok))
    print(
        "| batch | decoding | output tokens | tok/s | mask ms/step (wall) | mask ms/step "
        "(CPU) | answers that parse |"
    )
    print("|---|---|---|---|---|---|---|")
    for b, label, n, rate, mw, mc, ok in rows:
        print(
            f"| {b} | {label} | {n} | {rate:.1f} | {_ms(mw)} | {_ms(mc)} | "
            f"{'–' if ok is None else f'{ok} / {b}'} |"
        )
    llm.close()


def _ms(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f}"


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


if __name__ == "__main__":
    main()
