"""Decode speed of llama.cpp (through llama-cpp-python) on a GGUF file, for a
same-machine, same-minute comparison with `kiln run`.

    python3 decode_speed.py MODEL.gguf [--threads 2] [--repeats 3] [--max-tokens 128]

Prints one JSON line per repeat with llama.cpp's own decode timing (its
`llama_perf_context` eval time over the generated tokens, so Python's
per-token overhead is not counted against it), then the median.
Greedy (temperature 0, top_k 1), the prompt of scripts/cpu-quant-bench.sh.
"""

import argparse
import json
import statistics

from llama_cpp import Llama, llama_cpp

PROMPT = "Write a long story about a dragon who learns to code."


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    a = ap.parse_args()
    m = Llama(model_path=a.model, n_threads=a.threads, n_ctx=1024, verbose=False, seed=0)
    rates = []
    for r in range(a.repeats):
        m.reset()
        llama_cpp.llama_perf_context_reset(m.ctx)
        out = m(PROMPT, max_tokens=a.max_tokens, temperature=0.0, top_k=1)
        perf = llama_cpp.llama_perf_context(m.ctx)
        tps = 1000.0 * perf.n_eval / perf.t_eval_ms if perf.t_eval_ms > 0 else 0.0
        rates.append(tps)
        print(json.dumps({"repeat": r, "generated": out["usage"]["completion_tokens"],
                          "eval_tokens": perf.n_eval, "eval_ms": perf.t_eval_ms,
                          "decode_tokens_per_s": round(tps, 1)}), flush=True)
    print(json.dumps({"threads": a.threads, "median_decode_tokens_per_s": round(statistics.median(rates), 1),
                      "system_info": llama_cpp.llama_print_system_info().decode().strip()}))


if __name__ == "__main__":
    main()
