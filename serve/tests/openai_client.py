"""Drives a running `kiln-serve` with the official `openai` client (and raw
HTTP for malformed requests) and checks what the OpenAI API promises.

Usage: python3 openai_client.py http://127.0.0.1:PORT

Started by serve/tests/openai_smollm2.rs against SmolLM2-135M-Instruct on the
CPU backend. Loopback only; every call has a timeout; exits non-zero on the
first failed check.
"""

import concurrent.futures
import json
import sys
import time
import urllib.error
import urllib.request

import openai

BASE = sys.argv[1].rstrip("/")
client = openai.OpenAI(base_url=BASE + "/v1", api_key="unused", max_retries=0, timeout=300)
MODEL = "smollm2"
FRANCE = "What is the capital of France? Answer in one sentence."


def check(name, ok, detail=""):
    if not ok:
        print(f"FAILED: {name}: {detail}", flush=True)
        sys.exit(1)
    print(f"ok: {name}", flush=True)


def raw(method, path, body=None, data=None):
    """(status, parsed JSON or text) of a raw HTTP request."""
    if body is not None:
        data = json.dumps(body).encode()
    req = urllib.request.Request(BASE + path, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


def metrics():
    with urllib.request.urlopen(BASE + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out, text


def complete(prompt, **kw):
    r = client.completions.create(model=MODEL, prompt=prompt, temperature=0, **kw)
    return r.choices[0].text, r.choices[0].finish_reason


def stream_complete(prompt, **kw):
    s = client.completions.create(model=MODEL, prompt=prompt, temperature=0, stream=True, **kw)
    return "".join(c.choices[0].text for c in s if c.choices)


# --- health, models -------------------------------------------------------
status, body = raw("GET", "/health")
check("health is ok", status == 200 and body == {"status": "ok"}, f"{status} {body}")
models = client.models.list()
ids = [m.id for m in models.data]
check("/v1/models lists the model", ids == [MODEL], str(ids))
status, listed = raw("GET", "/v1/models")
max_context = listed["data"][0]["max_model_len"]

# --- chat, non-streaming and streaming -----------------------------------
r = client.chat.completions.create(
    model=MODEL, messages=[{"role": "user", "content": FRANCE}], temperature=0, max_tokens=40
)
text = r.choices[0].message.content
check("chat completion mentions Paris", "Paris" in text, repr(text))
check("chat usage counts tokens",
      r.usage.prompt_tokens > 10 and r.usage.completion_tokens > 0
      and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens, str(r.usage))
check("chat finish reason is stop or length", r.choices[0].finish_reason in ("stop", "length"),
      r.choices[0].finish_reason)

chunks = list(client.chat.completions.create(
    model=MODEL, messages=[{"role": "user", "content": FRANCE}], temperature=0, max_tokens=40,
    stream=True, stream_options={"include_usage": True}))
streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
check("streamed chat equals the non-streamed one", streamed == text, f"{streamed!r} vs {text!r}")
check("the stream ends with usage", chunks[-1].usage is not None
      and chunks[-1].usage.completion_tokens == r.usage.completion_tokens, str(chunks[-1]))
check("the stream has a finish reason",
      any(c.choices and c.choices[0].finish_reason for c in chunks), "")

# The raw stream ends with data: [DONE].
req = urllib.request.Request(BASE + "/v1/completions", method="POST", data=json.dumps(
    {"model": MODEL, "prompt": "Hello", "max_tokens": 3, "stream": True}).encode())
req.add_header("Content-Type", "application/json")
with urllib.request.urlopen(req, timeout=120) as resp:
    events = [l for l in resp.read().decode().splitlines() if l.startswith("data: ")]
check("a raw stream ends with data: [DONE]", events and events[-1] == "data: [DONE]", str(events[-3:]))

# --- logprobs -------------------------------------------------------------
r = client.chat.completions.create(
    model=MODEL, messages=[{"role": "user", "content": FRANCE}], temperature=0, max_tokens=5,
    logprobs=True, top_logprobs=3)
lp = r.choices[0].logprobs.content
check("logprobs come per token with 3 alternatives",
      len(lp) >= 1 and all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in lp), str(lp)[:300])
check("greedy tokens are the most likely ones",
      all(abs(t.logprob - t.top_logprobs[0].logprob) < 1e-4 for t in lp), str(lp)[:300])

# --- 32 concurrent greedy streams equal the same requests run alone ------
prompts = [f"The number {i} is" if i % 2 else f"My favourite colour is number {i}, and"
           for i in range(32)]
alone = [stream_complete(p, max_tokens=6) for p in prompts]
with concurrent.futures.ThreadPoolExecutor(32) as pool:
    together = list(pool.map(lambda p: stream_complete(p, max_tokens=6), prompts))
diff = [(p, a, t) for p, a, t in zip(prompts, alone, together) if a != t]
check("32 concurrent greedy streams equal their runs alone", not diff, str(diff[:3]))
check("the concurrent streams are not all empty", sum(len(a) for a in alone) > 32, str(alone[:4]))
m, _ = metrics()
check("batches held more than one row", m["kiln_batch_rows_total"] > m["kiln_steps_total"],
      f"{m['kiln_batch_rows_total']} rows over {m['kiln_steps_total']} steps")

# --- seeded sampling repeats ---------------------------------------------
def sampled(seed):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Write a short poem about the sea."}],
        temperature=1.0, top_p=0.95, seed=seed, max_tokens=16)
    return r.choices[0].message.content

a, b = sampled(1234), sampled(1234)
check("a seeded sampled request repeated gives the same text", a == b and a, f"{a!r} vs {b!r}")
others = {sampled(s) for s in (1, 2, 3)}
check("other seeds give other texts", len(others | {a}) > 1, str(others))

# --- penalties, applied in the graph (max_tokens within the plan's slots) ---
def penalised(seed, temperature, **pen):
    # A prompt that makes greedy decoding repeat itself, so penalties on
    # the generated tokens have something to push against.
    r = client.completions.create(
        model=MODEL, prompt="sea sea sea sea sea sea sea sea sea sea sea sea",
        temperature=temperature, seed=seed, max_tokens=24, **pen)
    return r.choices[0].text

plain = penalised(7, 0)
heavy = penalised(7, 0, presence_penalty=2.0, frequency_penalty=1.0)
check("penalties change a greedy reply", heavy != plain, f"{plain!r} vs {heavy!r}")
check("a penalised greedy reply repeats", heavy == penalised(7, 0, presence_penalty=2.0,
      frequency_penalty=1.0), heavy)
pa = penalised(99, 0.9, presence_penalty=0.5, frequency_penalty=0.5)
pb = penalised(99, 0.9, presence_penalty=0.5, frequency_penalty=0.5)
check("a seeded penalised sampled request repeated gives the same text", pa == pb and pa,
      f"{pa!r} vs {pb!r}")

# --- stop strings ---------------------------------------------------------
full, _ = complete("Once upon a time", max_tokens=16)
words = full.split()
check("the stop test has words to stop at", len(words) >= 4, repr(full))
stop = " " + words[2]
cut = full[: full.index(stop)]
got, reason = complete("Once upon a time", max_tokens=16, stop=[stop])
check("a stop string ends the text before it", got == cut and reason == "stop",
      f"{got!r} vs {cut!r} ({reason})")
got_stream = stream_complete("Once upon a time", max_tokens=16, stop=[stop])
check("a stop string ends the stream before it", got_stream == cut, f"{got_stream!r} vs {cut!r}")

# --- a stream closed early frees its KV and the server goes on ------------
before, _ = metrics()
s = client.chat.completions.create(
    model=MODEL, messages=[{"role": "user", "content": "Tell me a very long story."}],
    temperature=0, max_tokens=200, stream=True)
seen = 0
for c in s:
    seen += 1
    if seen >= 3:
        break
s.close()
deadline = time.time() + 60
while True:
    m, text = metrics()
    if (m["kiln_running_sequences"] == 0 and m["kiln_kv_blocks_free"] == m["kiln_kv_blocks_total"]
            and m["kiln_disconnects_total"] > before["kiln_disconnects_total"]):
        break
    if time.time() > deadline:
        check("a closed stream frees its KV", False, text)
    time.sleep(0.2)
check("a closed stream frees its KV (metrics show it)", True)
text2, _ = complete("Hello", max_tokens=3)
check("the server keeps serving after a disconnect", isinstance(text2, str))

# --- bad requests are 400s naming the problem ------------------------------
def bad(name, body=None, data=None, param=None, says=None, path="/v1/chat/completions"):
    status, r = raw("POST", path, body=body, data=data)
    err = r.get("error", {}) if isinstance(r, dict) else {}
    ok = status == 400 and (param is None or err.get("param") == param) \
        and (says is None or says in err.get("message", ""))
    check(name, ok, f"{status} {r}")

msgs = [{"role": "user", "content": "hi"}]
bad("malformed JSON is a 400", data=b'{"messages": [', says="not valid JSON")
bad("missing messages is a 400 naming messages", body={"model": MODEL}, param="messages")
bad("negative max_tokens is a 400 naming max_tokens",
    body={"messages": msgs, "max_tokens": -5}, param="max_tokens")
bad("temperature 'hot' is a 400 naming temperature",
    body={"messages": msgs, "temperature": "hot"}, param="temperature")
bad("a prompt longer than the context is a 400",
    body={"prompt": "hello " * (max_context + 10), "max_tokens": 2}, path="/v1/completions",
    param="prompt", says="context")
bad("top_logprobs over 5 is a 400", body={"messages": msgs, "logprobs": True, "top_logprobs": 9},
    param="top_logprobs")
try:
    client.chat.completions.create(model=MODEL, messages=msgs, temperature="hot")
    check("the openai client sees a 400", False, "no error")
except openai.BadRequestError as e:
    check("the openai client sees a 400", e.status_code == 400, str(e))

status, body = raw("GET", "/health")
check("the server is healthy at the end", status == 200, f"{status} {body}")
m, _ = metrics()
check("graphs were replayed", m.get("kiln_steps_total", 0) > 0, "")
print("all checks passed", flush=True)
