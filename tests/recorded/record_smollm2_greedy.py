"""Records transformers' greedy continuation of SmolLM2-135M-Instruct (the GGUF `make setup` fetches) into
smollm2_greedy.json, the reference tests/models/test_smollm2.py compares our loaded model with (no
transformers import at test time). Run once, from the repository root, with the parity extra installed:

    .venv/bin/python tests/recorded/record_smollm2_greedy.py

The prompt ids are transformers' own chat template and tokenizer (from the same GGUF); the continuation is
`generate` with greedy decoding, fp32 on the CPU, 40 tokens with no EOS stop."""

from __future__ import annotations

import hashlib
import json
import pathlib

import torch
import transformers

ROOT = pathlib.Path(__file__).resolve().parents[2]
GGUF = ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
OUT = pathlib.Path(__file__).with_name("smollm2_greedy.json")
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
NEW_TOKENS = 40


def main() -> None:
    kw = dict(gguf_file=GGUF.name)
    tok = transformers.AutoTokenizer.from_pretrained(str(GGUF.parent), **kw)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(GGUF.parent), dtype=torch.float32, **kw)
    model.eval()
    enc = tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True, return_dict=True)
    prompt = [int(i) for i in enc["input_ids"]]
    with torch.no_grad():
        ids = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
    record = {
        "made_by": "python tests/recorded/record_smollm2_greedy.py",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "gguf": GGUF.name,
        "gguf_sha256": hashlib.sha256(GGUF.read_bytes()).hexdigest(),
        "messages": QUESTION,
        "prompt_ids": prompt,
        "greedy_ids": ids,
        "greedy_text": tok.decode(ids),
    }
    lines = ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in record.items())  # a list per line
    OUT.write_text("{\n" + lines + "\n}\n")
    print(f"wrote {OUT}: {record['greedy_text']!r}")


if __name__ == "__main__":
    main()
