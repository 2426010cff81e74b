"""Records transformers' SmolLM2 tokenizer (built from the GGUF `make setup` fetches) on
tests/models/test_tokenizer.py's texts and chats into smollm2_tokenizer.json: the reference that test compares
our GGUF tokenizer with, without building transformers' (~25 s: its GGUF conversion) in make test. Run once,
from the repository root, with the parity extra installed:

    .venv/bin/python tests/recorded/record_smollm2_tokenizer.py
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import sys

import transformers

ROOT = pathlib.Path(__file__).resolve().parents[2]
GGUF = ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
OUT = pathlib.Path(__file__).with_name("smollm2_tokenizer.json")
sys.path.insert(0, str(ROOT / "tests" / "models"))
from tokenizer_cases import CAPITAL, CONVO, FEATURE_MESSAGES, FEATURE_TEMPLATE, TEXTS  # noqa: E402


def main() -> None:
    hf = transformers.AutoTokenizer.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name)
    encode = [hf.encode(t, add_special_tokens=False) for t in TEXTS]
    record = {
        "made_by": "python tests/recorded/record_smollm2_tokenizer.py",
        "transformers": transformers.__version__,
        "gguf": GGUF.name,
        "gguf_sha256": hashlib.sha256(GGUF.read_bytes()).hexdigest(),
        "texts": TEXTS,
        "encode": encode,
        "decode_skip_special": [hf.decode(ids, skip_special_tokens=True) for ids in encode],
        "ids": {k: getattr(hf, k) for k in ("bos_token_id", "pad_token_id", "eos_token_id")}
        | {"len": len(hf)},
        "capital_text": hf.apply_chat_template(CAPITAL, tokenize=False, add_generation_prompt=True),
        "capital_ids": list(
            hf.apply_chat_template(CAPITAL, tokenize=True, add_generation_prompt=True, return_dict=True)[
                "input_ids"
            ]
        ),
        "convo_text": {
            str(gen): hf.apply_chat_template(CONVO, tokenize=False, add_generation_prompt=gen)
            for gen in (True, False)
        },
        "feature_text": hf.apply_chat_template(
            FEATURE_MESSAGES, chat_template=FEATURE_TEMPLATE, tokenize=False, add_generation_prompt=True
        ),
    }
    lines = ",\n".join(f" {json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}" for k, v in record.items())
    OUT.write_text("{\n" + lines + "\n}\n", encoding="utf-8")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
