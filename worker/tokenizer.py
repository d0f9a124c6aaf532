"""The model's tokenizer as a Hugging Face `tokenizers` JSON string, plus chat template and ids.

Built from GGUF metadata (byte-level BPE or SentencePiece vocabularies), read from a Hugging Face
directory, or made up for synthetic models. The coordinator receives these fields in READY and
never loads the model.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers


@dataclass
class TokenizerInfo:
    """Encode with `add_special_tokens=False` and prepend `bos_id` when `add_bos`: the JSON's own
    post-processor is not relied on, so every source adds BOS the same way."""

    tokenizer_json: str
    chat_template: str | None
    bos_id: int | None
    eos_ids: list[int]
    add_bos: bool


# GGUF token types (llama.cpp's llama_token_type)
_CONTROL, _USER_DEFINED, _BYTE = 3, 4, 6

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _bpe_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The split a byte-level vocabulary's merges were learned with, by llama.cpp's pre type."""
    if pre == "smollm":
        # llama.cpp isolates each digit (\p{N}) and then applies GPT-2's regex, as SmolLM2's
        # own tokenizer.json does.
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre in ("gpt-2", "default"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3"):
        return _split_then_bytes(_LLAMA3_SPLIT)
    if pre in ("qwen2", "deepseek-r1-qwen"):
        return _split_then_bytes(_QWEN2_SPLIT)
    raise ValueError(
        f"GGUF tokenizer pre-tokenizer type {pre!r} is not supported; supported: smollm, gpt-2, "
        "default, llama3/llama-bpe (and their aliases), qwen2"
    )


def _added_tokens(tokens: list[str], types: list[int]) -> list[AddedToken]:
    # Control tokens are special (skipped when decoding with skip_special_tokens); user-defined
    # ones are matched whole in the text but decode as text.
    return [
        AddedToken(token, special=kind == _CONTROL, normalized=False)
        for token, kind in zip(tokens, types, strict=True)
        if kind in (_CONTROL, _USER_DEFINED)
    ]


def _sentencepiece_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a token into two
    vocabulary pieces, best score first, as transformers' `generate_merges` orders them."""
    vocab = {token: index for index, token in enumerate(tokens)}
    merges = []
    for token, score in zip(tokens, scores, strict=True):
        local = [
            (token[:i], token[i:], score)
            for i in range(1, len(token))
            if token[:i] in vocab and token[i:] in vocab
        ]
        merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _gguf_bpe(meta: Mapping[str, Any]) -> Tokenizer:
    tokens = meta["tokenizer.ggml.tokens"]
    vocab = {token: index for index, token in enumerate(tokens)}
    merges = [tuple(merge.split(" ")) for merge in meta["tokenizer.ggml.merges"]]
    tokenizer = Tokenizer(models.BPE(vocab, merges))
    tokenizer.pre_tokenizer = _bpe_pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"))
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _gguf_sentencepiece(meta: Mapping[str, Any]) -> Tokenizer:
    tokens = meta["tokenizer.ggml.tokens"]
    vocab = {token: index for index, token in enumerate(tokens)}
    merges = _sentencepiece_merges(tokens, meta["tokenizer.ggml.scores"])
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    tokenizer = Tokenizer(
        models.BPE(
            vocab,
            merges,
            unk_token=None if unk is None else tokens[unk],
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        prepend_scheme="first" if prefix else "never", split=False
    )
    decode = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence(
        [*decode, decoders.Strip(" ", 1, 0)] if prefix else decode
    )
    return tokenizer


def gguf_tokenizer(meta: Mapping[str, Any]) -> TokenizerInfo:
    """From GGUF metadata (`tokenizer.ggml.*`, `tokenizer.chat_template`)."""
    kind = meta.get("tokenizer.ggml.model")
    if kind == "gpt2":
        tokenizer = _gguf_bpe(meta)
    elif kind == "llama":
        tokenizer = _gguf_sentencepiece(meta)
    else:
        raise ValueError(
            f"GGUF tokenizer model {kind!r} is not supported; supported: gpt2 (byte-level BPE), "
            "llama (SentencePiece)"
        )
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type", [1] * len(tokens))
    tokenizer.add_tokens(_added_tokens(tokens, types))
    eos_keys = ("eos_token_id", "eot_token_id", "eom_token_id")
    eos_ids = [meta[f"tokenizer.ggml.{key}"] for key in eos_keys if f"tokenizer.ggml.{key}" in meta]
    return TokenizerInfo(
        tokenizer_json=tokenizer.to_str(),
        chat_template=meta.get("tokenizer.chat_template"),
        bos_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_ids=list(dict.fromkeys(eos_ids)),
        # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise.
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama")),
    )


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_id(tokenizer: Tokenizer, token: str | dict | None) -> int | None:
    if isinstance(token, dict):
        token = token.get("content")
    return None if token is None else tokenizer.token_to_id(token)


def _chat_template(directory: Path, config: dict) -> str | None:
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {entry["name"]: entry["template"] for entry in template}
        return named.get("default")
    return template


def _ids(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def hf_tokenizer(directory: Path) -> TokenizerInfo:
    """From a Hugging Face directory: tokenizer.json, tokenizer_config.json and, when present,
    chat_template.jinja, generation_config.json and config.json (for extra EOS ids)."""
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"{directory} has no tokenizer.json")
    tokenizer_json = path.read_text()
    tokenizer = Tokenizer.from_str(tokenizer_json)
    config = _read_json(directory / "tokenizer_config.json")
    bos_id = _token_id(tokenizer, config.get("bos_token"))
    eos_ids = [
        *[i for i in [_token_id(tokenizer, config.get("eos_token"))] if i is not None],
        *_ids(_read_json(directory / "generation_config.json").get("eos_token_id")),
        *_ids(_read_json(directory / "config.json").get("eos_token_id")),
    ]
    add_bos = config.get("add_bos_token")
    if add_bos is None:
        # Llama 3 style: no flag, the tokenizer.json post-processor adds it.
        add_bos = bos_id is not None and tokenizer.encode("").ids[:1] == [bos_id]
    return TokenizerInfo(
        tokenizer_json=tokenizer_json,
        chat_template=_chat_template(directory, config),
        bos_id=bos_id,
        eos_ids=list(dict.fromkeys(eos_ids)),
        add_bos=bool(add_bos),
    )


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable spelling of each byte, the alphabet of byte-level vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    spelling = {b: chr(b) for b in printable}
    extra = (b for b in range(256) if b not in spelling)
    spelling.update((b, chr(256 + n)) for n, b in enumerate(extra))
    return spelling


SYNTHETIC_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
SYNTHETIC_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def byte_level_tokenizer(vocab_size: int) -> TokenizerInfo:
    """One token per byte (ids 0-255), then `SYNTHETIC_SPECIALS`, then unused specials up to
    `vocab_size`; EOS is `<|im_end|>` and `<|endoftext|>`, no BOS."""
    n_used = 256 + len(SYNTHETIC_SPECIALS)
    if vocab_size < n_used:
        raise ValueError(f"a byte-level tokenizer needs a vocabulary of at least {n_used}")
    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    tokenizer = Tokenizer(models.BPE(vocab, []))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    unused = [f"<|unused_{i}|>" for i in range(vocab_size - n_used)]
    tokenizer.add_special_tokens([AddedToken(t, normalized=False) for t in SYNTHETIC_SPECIALS])
    tokenizer.add_special_tokens([AddedToken(t, normalized=False) for t in unused])
    return TokenizerInfo(
        tokenizer_json=tokenizer.to_str(),
        chat_template=SYNTHETIC_CHAT_TEMPLATE,
        bos_id=None,
        eos_ids=[256 + SYNTHETIC_SPECIALS.index("<|im_end|>"), 256],
        add_bos=False,
    )
