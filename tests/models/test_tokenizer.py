"""Tokenizers: GGUF/HF-dir tokenizers against transformers, chat-template rendering, ByteTokenizer."""

from __future__ import annotations

import json
import pathlib

import gguf
import jinja2
import numpy as np
import pytest

from tests.models.tokenizer_cases import CAPITAL, CONVO, FEATURE_MESSAGES, FEATURE_TEMPLATE, TEXTS
from tlt_jax.models.gguf import read_gguf
from tlt_jax.models.tokenizer import (
    BYTE_SPECIAL_TOKENS,
    ByteTokenizer,
    Tokenizer,
    _byte_alphabet,
    tokenizer_from_gguf,
    tokenizer_from_hf_dir,
)

# transformers' tokenizer built from the same GGUF, on the cases above: recorded once by
# tests/recorded/record_smollm2_tokenizer.py (building it takes ~25 s, its GGUF conversion)
HF = json.loads(
    (pathlib.Path(__file__).parents[1] / "recorded" / "smollm2_tokenizer.json").read_text("utf-8")
)
SMOL_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@pytest.fixture(scope="module")
def smol_gguf(smollm_gguf_path):
    """The real GGUF, parsed once."""
    return read_gguf(smollm_gguf_path)


@pytest.fixture(scope="module")
def smol_tok(smol_gguf) -> Tokenizer:
    return tokenizer_from_gguf(smol_gguf)


# ------------------------------------------------------------------------------------------- real GGUF
def test_recorded_cases_are_this_files_cases() -> None:
    assert HF["texts"] == TEXTS, "rerun tests/recorded/record_smollm2_tokenizer.py"


@pytest.mark.slow
def test_gguf_tokenizer_encodes_like_transformers(smol_tok):
    """Digits, unicode, whitespace and special tokens give the same ids as transformers' GGUF tokenizer."""
    for text, ids in zip(TEXTS, HF["encode"], strict=True):
        assert smol_tok.encode(text) == ids, text
    assert smol_tok.encode_batch(TEXTS) == [smol_tok.encode(t) for t in TEXTS]


@pytest.mark.slow
def test_gguf_tokenizer_special_tokens_and_ids(smol_tok):
    assert smol_tok.vocab_size == HF["ids"]["len"] == 49152
    assert smol_tok.encode("<|im_start|>") == [1]
    assert smol_tok.encode("<|im_end|>") == [2]
    assert smol_tok.bos_token_id == HF["ids"]["bos_token_id"] == 1
    assert smol_tok.pad_token_id == HF["ids"]["pad_token_id"] == 2
    # Declared eos (<|im_end|>) first, then <|endoftext|> which also ends a turn.
    assert smol_tok.eos_token_id == HF["ids"]["eos_token_id"] == 2
    assert smol_tok.eos_token_ids == (2, 0)
    # SmolLM2's GGUF says add_bos_token = false: add_special_tokens must not invent a bos.
    assert smol_tok.encode("hi", add_special_tokens=True) == smol_tok.encode("hi")
    # Digits are isolated (SmolLM2's "smollm" pre-tokenizer): one token per digit.
    digits = smol_tok.encode("9876543210")
    assert len(digits) == 10 and [smol_tok.decode([i]) for i in digits] == list("9876543210")


@pytest.mark.slow
def test_gguf_decode_round_trip(smol_tok):
    for text, hf_decoded in zip(TEXTS, HF["decode_skip_special"], strict=True):
        ids = smol_tok.encode(text)
        assert smol_tok.decode(ids, skip_special_tokens=False) == text
        assert smol_tok.decode(ids) == hf_decoded
    ids = smol_tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert smol_tok.decode(ids) == "user\nhi"


@pytest.mark.slow
def test_gguf_chat_template_matches_transformers(smol_tok):
    """SmolLM2's template inserts its default system prompt when there is no system message."""
    text = smol_tok.apply_chat_template(CAPITAL)
    assert text == HF["capital_text"]
    assert text == (
        f"<|im_start|>system\n{SMOL_SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert smol_tok.encode_chat(CAPITAL) == HF["capital_ids"]
    for gen in (True, False):
        assert smol_tok.apply_chat_template(CONVO, add_generation_prompt=gen) == HF["convo_text"][str(gen)]
    assert SMOL_SYSTEM not in smol_tok.apply_chat_template(CONVO)


@pytest.mark.slow
def test_template_features_render_like_transformers(smol_tok):
    """trim_blocks/lstrip_blocks, bos/eos variables, tojson and raise_exception behave as in transformers."""
    ours = Tokenizer(
        smol_tok.backend,
        chat_template=FEATURE_TEMPLATE,
        bos_token=smol_tok.bos_token,
        eos_token=smol_tok.eos_token,
    )
    assert ours.apply_chat_template(FEATURE_MESSAGES) == HF["feature_text"]
    with pytest.raises(jinja2.exceptions.TemplateError, match="bad role system"):
        ours.apply_chat_template([{"role": "system", "content": "x"}])


@pytest.mark.slow
def test_hf_dir_saved_by_transformers_loads_identically(smol_tok, tmp_path):
    """A tokenizer directory written by transformers (tokenizer.json + config + template: its
    PreTrainedTokenizerFast over SmolLM2's vocabulary and template) loads the same."""
    transformers = pytest.importorskip("transformers")
    specials = dict(bos_token=smol_tok.bos_token, eos_token=smol_tok.eos_token, pad_token="<|im_end|>")
    hf_tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=smol_tok.backend, chat_template=smol_tok.chat_template, **specials
    )
    hf_tok.save_pretrained(tmp_path)
    tok = tokenizer_from_hf_dir(tmp_path)
    for text in TEXTS:
        assert tok.encode(text) == smol_tok.encode(text), text
    assert tok.apply_chat_template(CAPITAL) == smol_tok.apply_chat_template(CAPITAL)
    assert (tok.eos_token_id, tok.bos_token_id, tok.pad_token_id, tok.vocab_size) == (2, 1, 2, 49152)
    assert set(tok.eos_token_ids) == {0, 2}


@pytest.mark.slow
def test_save_round_trip_and_generation_config(smol_tok, tmp_path):
    smol_tok.save(tmp_path)
    tok = tokenizer_from_hf_dir(tmp_path)
    assert tok.eos_token_ids == smol_tok.eos_token_ids
    assert [tok.encode(t) for t in TEXTS] == [smol_tok.encode(t) for t in TEXTS]
    assert tok.apply_chat_template(CAPITAL) == smol_tok.apply_chat_template(CAPITAL)
    # generation_config.json eos ids add stop tokens; a list-form chat_template picks "default".
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "DEF"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = tokenizer_from_hf_dir(tmp_path)
    assert tok.eos_token_ids == (2, 5, 0)
    assert tok.apply_chat_template(CAPITAL) == "DEF"


def test_hf_dir_template_from_jinja_file(tmp_path):
    ByteTokenizer().save(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert tokenizer_from_hf_dir(tmp_path).apply_chat_template([{"role": "user", "content": "a"}]) == "[a]"


def test_hf_dir_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        tokenizer_from_hf_dir(tmp_path)
    ByteTokenizer().save(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["eos_token"] = "<not-a-token>"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="eos_token '<not-a-token>' is not in the vocabulary"):
        tokenizer_from_hf_dir(tmp_path)


# ------------------------------------------------------------------------------------------- tiny GGUF
def _write_tokenizer_gguf(path: pathlib.Path, pre: str = "default", add_bos: bool = False) -> list[str]:
    """A GGUF with only tokenizer metadata: 256 bytes, merges "ab"/"abc"/"12", 3 specials, 1 user token."""
    spelling = _byte_alphabet()
    tokens = [spelling[b] for b in range(256)] + ["ab", "abc", "<s>", "</s>", "<|im_end|>", "<think>", "12"]
    types = [1] * 258 + [3, 3, 3, 4, 1]
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["a b", "ab c", "1 2"])
    w.add_bos_token_id(258)
    w.add_eos_token_id(259)
    w.add_eot_token_id(260)
    w.add_add_bos_token(add_bos)
    w.add_chat_template("{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tokens


def test_tiny_gguf_tokenizer_merges_specials_and_inputs(tmp_path):
    """Merges apply, control/user-defined tokens stay whole, and path/GGUFFile/GGUFReader inputs agree."""
    path = tmp_path / "tok.gguf"
    _write_tokenizer_gguf(path, add_bos=True)
    for source in (path, str(path), read_gguf(path), gguf.GGUFReader(path)):
        tok = tokenizer_from_gguf(source)
        assert tok.vocab_size == 263
        assert tok.encode("abcab c<think>é</s>") == [257, 256, ord(" "), ord("c"), 261, 0xC3, 0xA9, 259]
        assert tok.encode("ab", add_special_tokens=True) == [258, 256]  # add_bos_token = true
        assert tok.eos_token_ids == (259, 260)  # eos, then eot from tokenizer.ggml.eot_token_id
        assert tok.bos_token_id == 258 and tok.pad_token_id == 259  # no pad token: pad with eos
        assert tok.decode([257, 261, 259]) == "abc<think>"  # specials skipped, user-defined kept
        assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<s>hi</s>"


@pytest.mark.parametrize(
    "pre,merged", [("default", True), ("llama-bpe", True), ("smollm", False), ("qwen2", False)]
)
def test_tiny_gguf_pretokenizers_split_digits_as_declared(tmp_path, pre, merged):
    """SmolLM2/Qwen2 isolate every digit before BPE (the "1 2" merge never applies); GPT-2/Llama 3 do not."""
    path = tmp_path / "tok.gguf"
    _write_tokenizer_gguf(path, pre=pre)
    tok = tokenizer_from_gguf(path)
    assert tok.encode("x12") == ([ord("x"), 262] if merged else [ord("x"), ord("1"), ord("2")])
    assert tok.decode(tok.encode("x12 ab")) == "x12 ab"


def test_tiny_gguf_unsupported_pretokenizer(tmp_path):
    path = tmp_path / "tok.gguf"
    _write_tokenizer_gguf(path, pre="made-up-pre")
    with pytest.raises(ValueError, match="pre-tokenizer 'made-up-pre' is not supported.*smollm"):
        tokenizer_from_gguf(path)


def test_missing_gguf_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        tokenizer_from_gguf(tmp_path / "nope.gguf")


# ------------------------------------------------------------------------------------------- ByteTokenizer
def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    assert tok.vocab_size == 256 + len(BYTE_SPECIAL_TOKENS) == 261
    for text in TEXTS[:5] + ["\x00\x01 ctrl", "Ωmega 🙂"]:
        ids = tok.encode(text)
        assert ids == list(text.encode("utf-8"))
        assert tok.decode(ids) == text
    ids = tok.encode("<|im_start|>a<|im_end|><eos>")
    assert ids == [259, 97, 260, 257]
    assert tok.decode(ids) == "a"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>a<|im_end|><eos>"
    assert tok.encode("hi", add_special_tokens=True) == [256, 104, 105]
    assert tok.decode([0xC3]) == "\ufffd"  # a cut multi-byte character decodes to U+FFFD, not an error
    assert (tok.bos_token_id, tok.pad_token_id, tok.eos_token_ids) == (256, 258, (257, 260))
    rng = np.random.default_rng(0)
    raw = bytes(rng.integers(32, 127, size=200).astype(np.uint8))
    assert tok.decode(tok.encode(raw.decode())) == raw.decode()


def test_byte_tokenizer_chat_template():
    tok = ByteTokenizer()
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q?"}]
    text = tok.apply_chat_template(msgs)
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ?<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(msgs, add_generation_prompt=False).endswith("Q?<|im_end|>\n")
    ids = tok.encode_chat(msgs)
    assert ids[0] == 259 and ids.count(259) == 3 and ids.count(260) == 2
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_byte_tokenizer_dir_loads_in_transformers(tmp_path):
    """`save` writes a directory that transformers reads with the same ids and template."""
    transformers = pytest.importorskip("transformers")
    tok = ByteTokenizer()
    tok.save(tmp_path)
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    text = "héllo <|im_end|> 42"
    assert ref.encode(text, add_special_tokens=False) == tok.encode(text)
    msgs = [{"role": "user", "content": "hi"}]
    ref_text = ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert ref_text == tok.apply_chat_template(msgs)
    back = tokenizer_from_hf_dir(tmp_path)
    assert back.eos_token_ids == tok.eos_token_ids and back.encode(text) == tok.encode(text)


def test_no_chat_template_is_a_clear_error():
    tok = ByteTokenizer()
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template(CAPITAL)
