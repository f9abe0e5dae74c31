#!/usr/bin/env python3
"""Token ids of Gemma's own tokenizer (Google's SentencePiece) for a battery of texts.

The reference for kiln's Gemma-3 tokenizer. The GGUF carries the
SentencePiece vocabulary (pieces, scores, token types); this script rebuilds
the SentencePiece model from it (BPE, byte fallback, no dummy prefix, no
whitespace folding: Gemma's settings) with the `sentencepiece` package and
encodes each text. HF transformers' GGUF tokenizer conversion is not used: it
splits Gemma-3 words into many pieces and drops the BOS. Control tokens
(`<start_of_turn>`) are not matched in text by SentencePiece itself (the
Hugging Face tokenizer adds them as special tokens), so texts holding them
are not for this reference.

    python3 scripts/gemma3_sentencepiece_ids.py GGUF < texts.json > ids.json

stdin: a JSON list of strings; stdout: a JSON list of id lists (no BOS).
Needs `pip install gguf sentencepiece protobuf` (CI pins them in .ci/run);
exits with status 3 when one is missing.
"""

import json
import sys

try:
    import gguf
    from sentencepiece import SentencePieceProcessor
    from sentencepiece import sentencepiece_model_pb2 as pb
except ImportError as e:
    print(f"missing Python package: {e}", file=sys.stderr)
    sys.exit(3)


def field(r, key):
    f = r.fields[key]
    return f.contents()


def model_proto(path: str) -> bytes:
    r = gguf.GGUFReader(path)
    tokens = field(r, "tokenizer.ggml.tokens")
    scores = field(r, "tokenizer.ggml.scores")
    types = field(r, "tokenizer.ggml.token_type")
    m = pb.ModelProto()
    m.trainer_spec.model_type = pb.TrainerSpec.BPE
    m.trainer_spec.byte_fallback = True
    # Gemma's vocabulary has whitespace-run pieces (code indentation): the
    # text is not pre-split at spaces, and pieces may be all whitespace.
    m.trainer_spec.split_by_whitespace = False
    m.trainer_spec.allow_whitespace_only_pieces = True
    m.trainer_spec.unk_id = int(field(r, "tokenizer.ggml.unknown_token_id"))
    m.trainer_spec.bos_id = int(field(r, "tokenizer.ggml.bos_token_id"))
    m.trainer_spec.eos_id = int(field(r, "tokenizer.ggml.eos_token_id"))
    m.trainer_spec.pad_id = int(field(r, "tokenizer.ggml.padding_token_id"))
    m.normalizer_spec.name = "identity"
    m.normalizer_spec.add_dummy_prefix = False
    m.normalizer_spec.remove_extra_whitespaces = False
    m.normalizer_spec.escape_whitespaces = True
    kinds = {
        1: pb.ModelProto.SentencePiece.NORMAL,
        2: pb.ModelProto.SentencePiece.UNKNOWN,
        3: pb.ModelProto.SentencePiece.CONTROL,
        4: pb.ModelProto.SentencePiece.USER_DEFINED,
        5: pb.ModelProto.SentencePiece.UNUSED,
        6: pb.ModelProto.SentencePiece.BYTE,
    }
    unk = m.trainer_spec.unk_id
    for i, (t, s, k) in enumerate(zip(tokens, scores, types)):
        p = m.pieces.add()
        p.piece = t
        p.score = float(s)
        # llama.cpp marks <unk> as a control token; SentencePiece needs it UNKNOWN.
        p.type = pb.ModelProto.SentencePiece.UNKNOWN if i == unk else kinds[int(k)]
    return m.SerializeToString()


def main() -> None:
    sp = SentencePieceProcessor(model_proto=model_proto(sys.argv[1]))
    texts = json.load(sys.stdin)
    json.dump([sp.encode(t) for t in texts], sys.stdout)


if __name__ == "__main__":
    main()
