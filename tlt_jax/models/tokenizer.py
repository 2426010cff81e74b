"""Tokenizers for the policy models: built from a GGUF file's metadata, a HF model directory, or bytes.

Everything wraps a `tokenizers.Tokenizer` (the Rust BPE engine transformers uses), so encoding matches
transformers token for token without depending on transformers or torch at run time. Chat templates are
rendered with jinja2 exactly the way `transformers.PreTrainedTokenizerBase.apply_chat_template` renders
them (sandboxed environment, `trim_blocks`/`lstrip_blocks`, `raise_exception`, `tojson`, special-token
variables), because a prompt that differs by one whitespace from the model's training format changes the
model's answers.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from tlt_jax.models.gguf import GGUFFile, PathLike, read_gguf

# Tokens that end an assistant turn or a document in the common chat formats. When such a token is a special
# token of the vocabulary it is a stop token, in addition to the declared eos (SmolLM2 declares <|im_end|>
# but may also emit <|endoftext|>; Qwen2-Instruct declares <|im_end|> and lists <|endoftext|> in its
# generation_config).
END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<|eom_id|>")

# GGUF token types (llama.cpp `llama_token_type`).
_GGUF_TOKEN_CONTROL = 3
_GGUF_TOKEN_USER_DEFINED = 4

# Pre-tokenizer split regexes, keyed by GGUF `tokenizer.ggml.pre` (the same regexes llama.cpp and the
# models' own tokenizer.json files use).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_PRETOKENIZERS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
_GPT2_PRETOKENIZERS = ("default", "gpt2", "gpt-2")
_DIGIT_PRETOKENIZERS = ("smollm",)  # GPT-2 regex after isolating every digit (llama.cpp's SMOLLM pre type)
SUPPORTED_GGUF_PRETOKENIZERS = tuple(
    sorted((*_SPLIT_PRETOKENIZERS, *_GPT2_PRETOKENIZERS, *_DIGIT_PRETOKENIZERS))
)


@functools.lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable unicode character map (the spelling of byte-level BPE vocabularies)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # transformers overrides jinja's tojson (which HTML-escapes) with plain json.dumps.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compile_chat_template(template: str) -> jinja2.Template:
    """Compile a chat template in the same sandboxed jinja environment transformers uses."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


class Tokenizer:
    """A text <-> token-id codec plus the model's chat template and stop tokens.

    Wraps a `tokenizers.Tokenizer` backend. Special tokens are given by their text (as in
    tokenizer_config.json); `extra_eos_token_ids` adds stop ids beyond the declared eos (e.g.
    generation_config.json's eos list).
    `vocab_size` counts every id the tokenizer can produce (base vocabulary plus added tokens); a model's
    embedding table may be larger (padded), never smaller.
    """

    def __init__(
        self,
        backend: HFTokenizer,
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        unk_token: str | None = None,
        extra_eos_token_ids: Iterable[int] = (),
    ) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.pad_token = pad_token
        self.unk_token = unk_token
        for role, tok in (("bos", bos_token), ("eos", eos_token), ("pad", pad_token), ("unk", unk_token)):
            if tok is not None and backend.token_to_id(tok) is None:
                raise ValueError(
                    f"{role}_token {tok!r} is not in the vocabulary: fix the tokenizer files "
                    f"(tokenizer_config.json / GGUF metadata) or pass a token that exists."
                )
        if eos_token is None:
            raise ValueError("The tokenizer declares no eos token, so generation cannot stop: set eos_token.")
        ids = [backend.token_to_id(eos_token)]
        ids += [int(i) for i in extra_eos_token_ids]
        special = {t.content for t in backend.get_added_tokens_decoder().values() if t.special}
        ids += [backend.token_to_id(t) for t in END_OF_TURN_TOKENS if t in special]
        vocab = self.vocab_size
        for i in ids:
            if not 0 <= i < vocab:
                raise ValueError(f"eos token id {i} is outside the vocabulary [0, {vocab}).")
        self._eos_ids = tuple(dict.fromkeys(ids))  # de-duplicated, declared eos first

    # ----------------------------------------------------------------------------------------- properties
    @property
    def vocab_size(self) -> int:
        """Number of token ids (base vocabulary plus added tokens)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends generation: the declared eos first, then end-of-turn tokens."""
        return self._eos_ids

    @property
    def eos_token_id(self) -> int:
        """The declared eos id."""
        return self._eos_ids[0]

    @property
    def bos_token_id(self) -> int | None:
        """The bos id, or None when the model has no bos token."""
        return None if self.bos_token is None else self.backend.token_to_id(self.bos_token)

    @property
    def pad_token_id(self) -> int:
        """The padding id (the eos id when no pad token is declared: padded positions are masked anyway)."""
        return self.eos_token_id if self.pad_token is None else self.backend.token_to_id(self.pad_token)

    def token_to_id(self, token: str) -> int | None:
        """Id of a token given in its vocabulary spelling, or None if absent."""
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """Vocabulary spelling of a token id, or None if out of range."""
        return self.backend.id_to_token(token_id)

    # ----------------------------------------------------------------------------------------- codec
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. Special tokens written in the text (e.g. "<|im_start|>") encode as one token.

        `add_special_tokens=True` applies the tokenizer's post-processor (e.g. a leading bos), like HF's
        default; the default here is False because prompts come from the chat template, which writes its own
        special tokens.
        """
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]:
        """`encode` for many texts at once (parallel in the Rust backend)."""
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of token ids; special tokens are dropped unless `skip_special_tokens=False`."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    # ----------------------------------------------------------------------------------------- chat
    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> str:
        """Render `messages` ([{"role": ..., "content": ...}, ...]) with the model's chat template.

        Same rendering as transformers' `apply_chat_template(..., tokenize=False)`: keys whose value is None
        are dropped from messages, and the template sees `messages`, `add_generation_prompt`, `tools`,
        `documents`, the special tokens (`bos_token`, `eos_token`, `pad_token`, `unk_token`) and
        `template_kwargs`.
        """
        if self.chat_template is None:
            raise ValueError(
                "This tokenizer has no chat template: load one from a model that ships it (GGUF "
                "`tokenizer.chat_template`, tokenizer_config.json `chat_template` or chat_template.jinja) or "
                "set `tokenizer.chat_template`."
            )
        for m in messages:
            if not isinstance(m, dict):
                raise TypeError(f"Chat messages must be dicts {{'role': ..., 'content': ...}}, not {m!r}.")
        clean = [{k: v for k, v in m.items() if v is not None} for m in messages]
        variables: dict[str, Any] = {
            name: tok
            for name, tok in (
                ("bos_token", self.bos_token),
                ("eos_token", self.eos_token),
                ("unk_token", self.unk_token),
                ("pad_token", self.pad_token),
            )
            if tok is not None
        }
        variables.update(template_kwargs)
        template = _compile_chat_template(self.chat_template)
        return template.render(
            messages=clean,
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered chat (as transformers' `apply_chat_template(..., tokenize=True)`)."""
        text = self.apply_chat_template(messages, add_generation_prompt)
        return self.encode(text, add_special_tokens=False)

    # ----------------------------------------------------------------------------------------- saving
    def save(self, directory: PathLike) -> None:
        """Write tokenizer.json + tokenizer_config.json (+ generation_config.json eos ids) in HF layout.

        `tokenizer_from_hf_dir` (and transformers' AutoTokenizer) can load the result.
        """
        d = pathlib.Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(d / "tokenizer.json"))
        cfg: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
            cfg[name] = getattr(self, name)
        if self.chat_template is not None:
            cfg["chat_template"] = self.chat_template
        (d / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False))
        gen_path = d / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
        gen["eos_token_id"] = list(self.eos_token_ids)
        gen_path.write_text(json.dumps(gen, indent=2))

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(vocab_size={self.vocab_size}, eos_token_ids={self.eos_token_ids}, "
            f"bos_token_id={self.bos_token_id}, pad_token_id={self.pad_token_id})"
        )


# --------------------------------------------------------------------------------------------- GGUF
def _gguf_metadata(source: Any) -> dict[str, Any]:
    """GGUF metadata as a dict from a `GGUFFile`, a `gguf.GGUFReader`, or a path."""

    if isinstance(source, GGUFFile):
        return source.metadata
    if isinstance(source, (str, os.PathLike)):
        return read_gguf(source).metadata
    fields = getattr(source, "fields", None)  # gguf.GGUFReader
    if fields is None:
        raise TypeError(f"Expected a GGUF path, GGUFFile or gguf.GGUFReader, got {type(source).__name__}.")
    return {key: field.contents() for key, field in fields.items()}


def tokenizer_from_gguf(reader_or_path: Any) -> Tokenizer:
    """Build the byte-level BPE tokenizer described by a GGUF file's metadata (`tokenizer.ggml.*`).

    Accepts a path, a `tlt_jax.models.gguf.GGUFFile` or a `gguf.GGUFReader` (to avoid re-reading a file
    already open). Vocabulary and merges come from the metadata; the pre-tokenizer follows
    `tokenizer.ggml.pre` (e.g. SmolLM2's "smollm" isolates every digit, then applies the GPT-2 regex); control
    tokens (type 3) become special tokens and user-defined tokens (type 4) added tokens, so both encode as
    single tokens. The chat template and the bos/eos/pad ids come from the metadata too.
    """
    meta = _gguf_metadata(reader_or_path)
    model_type = meta.get("tokenizer.ggml.model")
    if model_type != "gpt2":
        raise ValueError(
            f"GGUF tokenizer type {model_type!r} is not supported: only byte-level BPE ('gpt2', used by "
            f"SmolLM2, Llama 3, Qwen2) is. Use the model's HF directory (tokenizer.json) instead."
        )
    tokens: list[str] = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError("GGUF metadata lacks tokenizer.ggml.tokens: the file holds no tokenizer.")
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges_raw: list[str] | None = meta.get("tokenizer.ggml.merges")
    if merges_raw is None:  # GGUFWriter drops an empty list: fine only for a pure byte vocabulary
        multi = [t for t, typ in zip(tokens, types, strict=True) if typ == 1 and len(t) > 1]
        if multi:
            raise ValueError(
                f"GGUF metadata has no tokenizer.ggml.merges but has multi-character tokens such as "
                f"{multi[0]!r}, which would be unreachable: re-export the GGUF with its merges."
            )
        merges_raw = []
    pre = meta.get("tokenizer.ggml.pre") or "default"

    # Byte-level vocabularies spell every token in GPT-2's byte alphabet; a few files store some tokens as
    # raw text instead: respell those (control/user-defined tokens keep their literal text: matched whole).
    alphabet = set(_byte_alphabet().values())
    spelling = _byte_alphabet()
    vocab: dict[str, int] = {}
    for i, (tok, typ) in enumerate(zip(tokens, types, strict=True)):
        if typ not in (_GGUF_TOKEN_CONTROL, _GGUF_TOKEN_USER_DEFINED) and not set(tok) <= alphabet:
            tok = "".join(spelling[b] for b in tok.encode("utf-8"))
        vocab.setdefault(tok, i)
    merges = [tuple(m.split(" ", 1)) for m in merges_raw]
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = _gguf_pre_tokenizer(pre)
    if pre in ("qwen2", "deepseek-r1-qwen"):
        backend.normalizer = normalizers.NFC()  # as in Qwen2's tokenizer.json
    backend.decoder = decoders.ByteLevel()

    control = [tokens[i] for i, t in enumerate(types) if t == _GGUF_TOKEN_CONTROL]
    user = [tokens[i] for i, t in enumerate(types) if t == _GGUF_TOKEN_USER_DEFINED]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    if backend.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise ValueError(
            f"GGUF tokenizer has {len(tokens)} tokens but the built vocabulary has "
            f"{backend.get_vocab_size(with_added_tokens=True)} (duplicate spellings?): the file is malformed."
        )

    def special(key: str) -> str | None:
        idx = meta.get(f"tokenizer.ggml.{key}_token_id")
        return None if idx is None else tokens[int(idx)]

    bos = special("bos")
    if meta.get("tokenizer.ggml.add_bos_token") and bos is not None:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
        )
    extra_eos = [
        int(i) for key in ("eot", "eom") if (i := meta.get(f"tokenizer.ggml.{key}_token_id")) is not None
    ]
    return Tokenizer(
        backend,
        chat_template=meta.get("tokenizer.chat_template"),
        bos_token=bos,
        eos_token=special("eos"),
        pad_token=special("padding"),
        unk_token=special("unknown"),
        extra_eos_token_ids=extra_eos,
    )


def _gguf_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """Pre-tokenizer for a GGUF `tokenizer.ggml.pre` name (how text is cut before BPE merges)."""
    if pre in _GPT2_PRETOKENIZERS:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_PRETOKENIZERS:
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    if pre in _SPLIT_PRETOKENIZERS:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLIT_PRETOKENIZERS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    raise ValueError(
        f"GGUF pre-tokenizer {pre!r} is not supported (supported: {', '.join(SUPPORTED_GGUF_PRETOKENIZERS)})."
        " "
        f"Use the model's HF directory (tokenizer.json) instead, or add its split regex to tokenizer.py."
    )


# --------------------------------------------------------------------------------------------- HF dir
def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or a serialized AddedToken dict."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and "content" in value:
        return value["content"]
    raise ValueError(f"Cannot read special token {value!r} from tokenizer_config.json: expected a string.")


def tokenizer_from_hf_dir(path: PathLike) -> Tokenizer:
    """Load the tokenizer of a HF model directory.

    Reads tokenizer.json (the fast-tokenizer file; required), tokenizer_config.json (bos/eos/pad/unk tokens
    and `chat_template`), chat_template.jinja (transformers >= 4.50 writes the template there) and
    generation_config.json (its `eos_token_id`, an int or a list, adds stop ids).
    """
    d = pathlib.Path(path)
    tok_file = d / "tokenizer.json"
    if not tok_file.is_file():
        raise FileNotFoundError(
            f"{tok_file} does not exist: the model directory needs a fast tokenizer file. Create it with "
            f"`transformers.AutoTokenizer.from_pretrained(<model>).save_pretrained('{d}')`."
        )
    backend = HFTokenizer.from_file(str(tok_file))
    cfg_file = d / "tokenizer_config.json"
    cfg: dict[str, Any] = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}

    template = cfg.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default")
    jinja_file = d / "chat_template.jinja"
    if template is None and jinja_file.is_file():
        template = jinja_file.read_text()

    extra_eos: list[int] = []
    gen_file = d / "generation_config.json"
    if gen_file.is_file():
        eos = json.loads(gen_file.read_text()).get("eos_token_id")
        extra_eos = [eos] if isinstance(eos, int) else list(eos or [])
    eos_token = _token_text(cfg.get("eos_token"))
    if eos_token is None and extra_eos:
        eos_token = backend.id_to_token(extra_eos[0])
    return Tokenizer(
        backend,
        chat_template=template,
        bos_token=_token_text(cfg.get("bos_token")),
        eos_token=eos_token,
        pad_token=_token_text(cfg.get("pad_token")),
        unk_token=_token_text(cfg.get("unk_token")),
        extra_eos_token_ids=extra_eos,
    )


# --------------------------------------------------------------------------------------------- bytes
BYTE_SPECIAL_TOKENS = ("<bos>", "<eos>", "<pad>", "<|im_start|>", "<|im_end|>")
BYTE_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ByteTokenizer(Tokenizer):
    """A complete byte-level tokenizer for tiny random models: one token per UTF-8 byte, no merges.

    Ids 0..255 are the bytes; 256.. are `BYTE_SPECIAL_TOKENS` (<bos>=256, <eos>=257, <pad>=258,
    <|im_start|>=259, <|im_end|>=260), so `vocab_size` is 261 and a model using it needs vocab_size >= 261.
    The chat template is ChatML without a default system prompt; <eos> and <|im_end|> both stop generation;
    `encode(..., add_special_tokens=True)` prepends <bos>.
    """

    def __init__(self) -> None:
        spelling = _byte_alphabet()
        vocab = {spelling[b]: b for b in range(256)}
        backend = HFTokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        backend.decoder = decoders.ByteLevel()
        specials = [AddedToken(t, special=True, normalized=False) for t in BYTE_SPECIAL_TOKENS]
        backend.add_special_tokens(specials)
        backend.post_processor = processors.TemplateProcessing(
            single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", 256)]
        )
        super().__init__(
            backend,
            chat_template=BYTE_CHAT_TEMPLATE,
            bos_token="<bos>",
            eos_token="<eos>",
            pad_token="<pad>",
            extra_eos_token_ids=(260,),
        )
