#!/usr/bin/env python3
"""Drive a running kiln-serve (or any OpenAI-compatible server) with N
concurrent streaming clients and report requests/s, output tokens/s, time to
first token and time per output token (p50, p99), as a table and JSON.

    scripts/bench-serve.py --url http://127.0.0.1:8000 --concurrency 1 8 32 \
        --requests 64 --max-tokens 128 [--chat] [--temperature 0.8] [--json out.json]

Standard library only. Each client sends its requests one after another;
prompts cycle through --prompts FILE (one per line) or a built-in set. Output
tokens are counted from the server's usage (stream_options.include_usage),
falling back to one token per streamed chunk. TPOT is per request:
(last token time - first token time) / (output tokens - 1).
"""

import argparse
import http.client
import json
import statistics
import sys
import threading
import time
import urllib.parse

DEFAULT_PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle stays upright.",
    "List five facts about the Moon.",
    "What is the capital of France? Answer in one sentence.",
    "Describe the water cycle for a child.",
    "Give three tips for learning a new language.",
    "Why is the sky blue?",
    "Summarize the plot of a heist movie you invent.",
]


def one_request(url, model, prompt, max_tokens, chat, temperature=0.0, seed=None):
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=600)
    if chat:
        path = "/v1/chat/completions"
        body = {"model": model, "messages": [{"role": "user", "content": prompt}]}
    else:
        path = "/v1/completions"
        body = {"model": model, "prompt": prompt}
    body.update({"max_tokens": max_tokens, "temperature": temperature, "stream": True,
                 "stream_options": {"include_usage": True}})
    if seed is not None:
        body["seed"] = seed
    t0 = time.perf_counter()
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
    first = last = None
    chunks = 0
    usage = None
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            break
        ev = json.loads(data)
        if "error" in ev:
            raise RuntimeError(ev["error"])
        if ev.get("usage"):
            usage = ev["usage"]
        for c in ev.get("choices", []):
            piece = c.get("text") if not chat else (c.get("delta") or {}).get("content")
            if piece:
                now = time.perf_counter()
                first = first or now
                last = now
                chunks += 1
    conn.close()
    tokens = usage["completion_tokens"] if usage else chunks
    ttft = (first - t0) if first else None
    tpot = (last - first) / (tokens - 1) if first and tokens > 1 else None
    return {"ttft": ttft, "tpot": tpot, "tokens": tokens, "latency": time.perf_counter() - t0}


def pct(xs, p):
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    k = min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))
    return xs[k]


def run_level(args, prompts, concurrency):
    results, errors = [], []
    lock = threading.Lock()
    counter = iter(range(args.requests))

    def worker():
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            try:
                r = one_request(args.url, args.model, prompts[i % len(prompts)],
                                args.max_tokens, args.chat, args.temperature,
                                None if args.seed is None else args.seed + i)
                with lock:
                    results.append(r)
            except Exception as e:  # reported, not fatal
                with lock:
                    errors.append(str(e))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    out_tokens = sum(r["tokens"] for r in results)
    ttft = [r["ttft"] for r in results]
    tpot = [r["tpot"] for r in results]
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "wall_s": wall,
        "requests_per_s": len(results) / wall,
        "output_tokens_per_s": out_tokens / wall,
        "ttft_p50_ms": ms(pct(ttft, 50)),
        "ttft_p99_ms": ms(pct(ttft, 99)),
        "tpot_p50_ms": ms(pct(tpot, 50)),
        "tpot_p99_ms": ms(pct(tpot, 99)),
        "tpot_mean_ms": ms(statistics.mean([t for t in tpot if t is not None]))
        if any(t is not None for t in tpot) else None,
    }


def ms(x):
    return None if x is None else x * 1000.0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="kiln")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--requests", type=int, default=64, help="requests per concurrency level")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompts", help="a file with one prompt per line")
    ap.add_argument("--chat", action="store_true", help="use /v1/chat/completions")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sampling temperature of every request (0: greedy)")
    ap.add_argument("--seed", type=int, help="seed of request i is SEED + i (default: unseeded)")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args()
    prompts = DEFAULT_PROMPTS
    if args.prompts:
        with open(args.prompts, encoding="utf-8") as f:
            prompts = [l.rstrip("\n") for l in f if l.strip()]
    levels = [run_level(args, prompts, c) for c in args.concurrency]
    cols = ["concurrency", "requests", "errors", "requests_per_s", "output_tokens_per_s",
            "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms"]
    print(" ".join(f"{c:>19}" for c in cols))
    for lv in levels:
        cells = []
        for c in cols:
            v = lv[c]
            cells.append(f"{v:>19.2f}" if isinstance(v, float) else f"{str(v):>19}")
        print(" ".join(cells))
    doc = {"url": args.url, "max_tokens": args.max_tokens, "chat": args.chat,
           "temperature": args.temperature, "levels": levels}
    print(json.dumps(doc, indent=2))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=2)
    if any(lv["errors"] for lv in levels):
        sys.exit(1)


if __name__ == "__main__":
    main()
