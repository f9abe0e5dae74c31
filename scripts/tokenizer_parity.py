#!/usr/bin/env python3
"""Token-id parity of kiln's imported tokenizer against Hugging Face.

`kiln import` builds tokenizer.json from a GGUF's vocabulary. This script
loads the same GGUF with Hugging Face transformers
(`AutoTokenizer.from_pretrained(dir, gguf_file=...)`), encodes a battery of
texts with both, and reports every difference in token ids, plus whether
each tokenizer decodes its ids back to the original text.

Usage (needs `pip install transformers tokenizers gguf`):

    kiln import SmolLM2-135M-Instruct.Q4_1.gguf -o /tmp/smol
    python3 scripts/tokenizer_parity.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf \
        --imported /tmp/smol --out bench/results/tokenizer-parity

It writes <out>.json (battery, Hugging Face ids, our ids, verdicts; the Rust
test `imported_smollm2_tokenizer_matches_recorded_hf_ids` re-checks the
Rust `tokenizers` crate against these recorded ids) and <out>.md (summary).
Exit status 1 when any id differs or any round trip fails.
"""

import argparse
import datetime
import json
import os
import platform
import sys

BATTERY = [
    ("ascii", "The quick brown fox jumps over the lazy dog."),
    ("contractions", "I'm sure they'll say it's fine, but we've seen what you'd do."),
    ("numbers", "In 2024, 3.14159 * 1,000,000 = 3141590 and 0x7fff is 32767."),
    ("mixed_case", "HTTPServer parsesJSON from an XMLHttpRequest; CamelCase vs snake_case."),
    ("punctuation", "Wait... what?! (Really.) \"Quotes\" -- and 'single' ones; ok: yes/no."),
    ("accents", "Crème brûlée, naïve façade, Ångström, Øresund, señor, Straße."),
    ("cjk_japanese", "日本語のテキストをトークン化します。東京は晴れです。"),
    ("cjk_chinese", "中文分词测试：今天天气很好，我们去公园散步吧。"),
    ("korean", "안녕하세요, 세계! 한국어 문장입니다."),
    ("cyrillic_greek", "Привет, мир! Καλημέρα κόσμε."),
    ("arabic_hebrew", "مرحبا بالعالم — שלום עולם"),
    ("emoji", "Launch 🚀 thumbs 👍🏽 family 👨‍👩‍👧‍👦 flag 🇫🇷 heart ❤️ done ✅"),
    ("combining", "e\u0301 vs \u00e9, zero\u200bwidth, soft\u00adhyphen, nbsp\u00a0here"),
    ("code_python", "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n"),
    ("code_rust", "fn main() {\n\tlet v: Vec<u32> = (0..10).map(|x| x * x).collect();\n\tprintln!(\"{v:?}\");\n}\n"),
    ("code_json", '{"name": "kiln", "version": [0, 1, 0], "tags": ["aot", "llm"], "ok": true}'),
    ("whitespace_runs", "a  b   c    d\t\te \t f     g"),
    ("leading_trailing", "   leading and trailing spaces   "),
    ("newlines", "line one\nline two\n\nline four\n\n\n\nline eight\r\nwindows\r\n"),
    ("only_whitespace", " \n\t  \n"),
    ("repeats", "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa!!!!!!!!????????.........------"),
    ("url_path", "See https://example.com/a/b?c=d&e=f#frag and /usr/local/bin/kiln --help."),
    ("markdown", "# Title\n\n- item **bold** _it_\n- `code`\n\n| a | b |\n|---|---|\n"),
    ("special_tokens_in_text", "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n"),
    ("special_adjacent", "x<|endoftext|>y<repo_name>z<file_sep>"),
    ("math", "∀x∈ℝ: x² ≥ 0, ∑ᵢ aᵢ ≤ ∞, α+β=γ"),
    ("empty", ""),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", required=True, help="the GGUF file")
    ap.add_argument("--imported", required=True, help="directory kiln import wrote")
    ap.add_argument("--out", required=True, help="output path without extension")
    args = ap.parse_args()

    import tokenizers
    import transformers
    from transformers import AutoTokenizer

    gguf = os.path.abspath(args.gguf)
    hf = AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
    ours = tokenizers.Tokenizer.from_file(os.path.join(args.imported, "tokenizer.json"))

    rows = []
    for name, text in BATTERY:
        hf_ids = hf.encode(text, add_special_tokens=False)
        our_ids = ours.encode(text, add_special_tokens=False).ids
        hf_with = hf.encode(text)  # with the model's own special-token policy
        our_with = ours.encode(text).ids
        rows.append(
            {
                "name": name,
                "text": text,
                "hf_ids": hf_ids,
                "our_ids": our_ids,
                "ids_equal": hf_ids == our_ids,
                "ids_equal_with_special_policy": hf_with == our_with,
                "our_roundtrip": ours.decode(our_ids, skip_special_tokens=False) == text,
                "hf_roundtrip": hf.decode(hf_ids, skip_special_tokens=False) == text,
            }
        )

    # The chat template, rendered by Hugging Face, tokenized by both.
    chat = [
        {"role": "user", "content": "What is 17 * 23? Answer briefly."},
        {"role": "assistant", "content": "17 × 23 = 391."},
    ]
    try:
        rendered = hf.apply_chat_template(chat, tokenize=False)
        hf_ids = hf.encode(rendered, add_special_tokens=False)
        our_ids = ours.encode(rendered, add_special_tokens=False).ids
        rows.append(
            {
                "name": "chat_template_rendered",
                "text": rendered,
                "hf_ids": hf_ids,
                "our_ids": our_ids,
                "ids_equal": hf_ids == our_ids,
                "ids_equal_with_special_policy": hf.encode(rendered) == ours.encode(rendered).ids,
                "our_roundtrip": ours.decode(our_ids, skip_special_tokens=False) == rendered,
                "hf_roundtrip": hf.decode(hf_ids, skip_special_tokens=False) == rendered,
            }
        )
    except Exception as e:  # a GGUF without a chat template
        print(f"chat template skipped: {e}", file=sys.stderr)

    vocab_equal = hf.get_vocab() == ours.get_vocab(with_added_tokens=True)
    n_ids = sum(len(r["hf_ids"]) for r in rows)
    failures = [r["name"] for r in rows if not (r["ids_equal"] and r["our_roundtrip"])]
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python3 " + " ".join(sys.argv),
        "gguf": os.path.basename(gguf),
        "versions": {
            "python": platform.python_version(),
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
        },
        "vocab_equal": vocab_equal,
        "texts": len(rows),
        "token_ids_compared": n_ids,
        "texts_with_different_ids": [r["name"] for r in rows if not r["ids_equal"]],
        "texts_failing_our_roundtrip": [r["name"] for r in rows if not r["our_roundtrip"]],
        "texts_failing_hf_roundtrip": [r["name"] for r in rows if not r["hf_roundtrip"]],
        "rows": rows,
    }
    with open(args.out + ".json", "w", encoding="utf-8") as f:
        json.dump(result, f, ensure_ascii=False, indent=1)
        f.write("\n")

    lines = [
        "# Tokenizer parity: kiln import vs Hugging Face transformers",
        "",
        f"- date: {result['date']}",
        f"- command: `{result['command']}`",
        f"- GGUF: `{result['gguf']}`",
        f"- versions: {result['versions']}",
        f"- vocabularies (with added tokens) identical: {vocab_equal}",
        f"- texts: {len(rows)}, token ids compared: {n_ids}",
        f"- texts with different ids: {result['texts_with_different_ids'] or 'none'}",
        f"- texts our tokenizer does not round-trip: {result['texts_failing_our_roundtrip'] or 'none'}",
        f"- texts HF does not round-trip: {result['texts_failing_hf_roundtrip'] or 'none'}",
        "",
        "| text | ids | equal | equal (default special policy) | our round trip | HF round trip |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['name']} | {len(r['hf_ids'])} | {r['ids_equal']} | "
            f"{r['ids_equal_with_special_policy']} | {r['our_roundtrip']} | {r['hf_roundtrip']} |"
        )
    with open(args.out + ".md", "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines[:11]))
    return 1 if failures or not vocab_equal else 0


if __name__ == "__main__":
    sys.exit(main())
