"""Tokenizers: a HF `tokenizer.json` through the `tokenizers` package, and a byte tokenizer for
demo models (random weights, no vocabulary files)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

TOKENIZER_FILE = "tokenizer.json"
BYTE_IDS = 256  # ByteTokenizer: ids 0..255 are the bytes themselves


@runtime_checkable
class Tokenizer(Protocol):
    vocab_size: int
    eos_token_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes 0..255 map to ids 0..255; ids 256.. are special (BOS = 256, EOS = 257, the rest
    unnamed). decode skips special ids and replaces invalid UTF-8."""

    def __init__(self, vocab_size: int = 512):
        if not isinstance(vocab_size, int) or vocab_size < BYTE_IDS + 2:
            raise ValueError(f"vocab_size={vocab_size!r} must be an integer >= {BYTE_IDS + 2} "
                             f"(256 bytes + BOS + EOS)")
        self.vocab_size = vocab_size
        self.bos_token_id = BYTE_IDS
        self.eos_token_id = BYTE_IDS + 1
        self.eos_token_ids = (self.eos_token_id,)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        bad = [i for i in ids if not 0 <= int(i) < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        return bytes(int(i) for i in ids if int(i) < BYTE_IDS).decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizer.json` (HF tokenizers). encode adds no special tokens (chat templates are the
    caller's business); decode skips special tokens."""

    def __init__(self, path: str | os.PathLike, eos_token_ids: tuple[int, ...] = ()):
        from tokenizers import Tokenizer as _Tok

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file {str(path)!r} does not exist")
        self._tok = _Tok.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_token_ids = tuple(eos_token_ids)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON ({e})") from None


def _as_ids(value: Any, where: str) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return tuple(value)
    raise ValueError(f"{where}: eos_token_id={value!r} must be an int or a list of ints")


def eos_token_ids(directory: str | os.PathLike, cfg_dict: dict[str, Any] | None = None) -> tuple[int, ...]:
    """EOS ids from generation_config.json (preferred) else config.json's eos_token_id (the wrapped
    multimodal configs keep it in text_config). `cfg_dict` is the parsed config.json; read from
    `directory` when None. Returns () when neither names one."""
    directory = Path(directory)
    gen = directory / "generation_config.json"
    if gen.is_file():
        ids = _as_ids(_read_json(gen).get("eos_token_id"), str(gen))
        if ids:
            return ids
    if cfg_dict is None:
        cfg_path = directory / "config.json"
        cfg_dict = _read_json(cfg_path) if cfg_path.is_file() else {}
    ids = _as_ids(cfg_dict.get("eos_token_id"), "config.json")
    if not ids and isinstance(cfg_dict.get("text_config"), dict):
        ids = _as_ids(cfg_dict["text_config"].get("eos_token_id"), "config.json text_config")
    return ids


def load_tokenizer(directory: str | os.PathLike, cfg_dict: dict[str, Any] | None = None) -> HFTokenizer | None:
    """HFTokenizer for <directory>/tokenizer.json with its EOS ids, or None when there is none."""
    path = Path(directory) / TOKENIZER_FILE
    if not path.is_file():
        return None
    return HFTokenizer(path, eos_token_ids(directory, cfg_dict))
