"""Tokenizers: a HF `tokenizer.json` through the `tokenizers` package, and a byte tokenizer for
demo models (random weights, no vocabulary files). Both render chat messages to text with a jinja2
chat template, as transformers' `apply_chat_template` does: the checkpoint's own template
(chat_template.jinja, else tokenizer_config.json's "chat_template"), or a tiny built-in one for
the byte tokenizer."""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # transformers >= 4.50 saves the template here; it wins
BYTE_IDS = 256  # ByteTokenizer: ids 0..255 are the bytes themselves
# The demo models' template: one "<|role|>" header line per message, then the assistant header.
BYTE_CHAT_TEMPLATE = ("{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
                      "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
# Named special tokens a template may use, as transformers passes them (its special_tokens_map).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """Chat messages that cannot be rendered: no template, malformed messages, or a template error."""


@runtime_checkable
class Tokenizer(Protocol):
    vocab_size: int
    eos_token_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True,
                            **template_vars: Any) -> str: ...


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
        self.chat_template = BYTE_CHAT_TEMPLATE

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True,
                            **template_vars: Any) -> str:
        """Chat messages -> prompt text with the built-in template (see render_chat)."""
        return render_chat(self.chat_template, messages, add_generation_prompt=add_generation_prompt, **template_vars)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        bad = [i for i in ids if not 0 <= int(i) < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        return bytes(int(i) for i in ids if int(i) < BYTE_IDS).decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizer.json` (HF tokenizers) plus the parsed tokenizer_config.json, if any. encode adds
    no special tokens (a chat template writes them as text, as transformers' apply_chat_template
    does); decode skips special tokens. chat_template is None when the checkpoint has none."""

    def __init__(self, path: str | os.PathLike, eos_token_ids: tuple[int, ...] = (), config: dict | None = None,
                 chat_template: str | None = None):
        from tokenizers import Tokenizer as _Tok

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file {str(path)!r} does not exist")
        self._tok = _Tok.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_token_ids = tuple(eos_token_ids)
        self.config = dict(config or {})
        self.chat_template = chat_template or _config_template(self.config)
        self.special_tokens = {name: _token_text(self.config[name]) for name in SPECIAL_TOKEN_NAMES
                               if _token_text(self.config.get(name)) is not None}
        self._source = path.parent

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True,
                            **template_vars: Any) -> str:
        """Chat messages -> prompt text with the checkpoint's template; bos_token, eos_token, ... are
        available to it; template_vars (e.g. tools=[...], enable_thinking=False) are passed through."""
        if not self.chat_template:
            raise ChatTemplateError(f"the tokenizer in {str(self._source)!r} has no chat template (no "
                                    f"{CHAT_TEMPLATE_FILE} and no chat_template in {TOKENIZER_CONFIG_FILE}); "
                                    f"pass the prompt as text or token ids instead of chat messages")
        return render_chat(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                           **{**self.special_tokens, **template_vars})

    def save(self, directory: str | os.PathLike) -> None:
        """Write tokenizer.json and tokenizer_config.json (with the chat template) to directory."""
        directory = Path(directory)
        self._tok.save(str(directory / TOKENIZER_FILE))
        config = dict(self.config)
        if self.chat_template:
            config["chat_template"] = self.chat_template
        if config:
            (directory / TOKENIZER_CONFIG_FILE).write_text(json.dumps(config, indent=2, ensure_ascii=False))

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
    """HFTokenizer for <directory>/tokenizer.json with its EOS ids and tokenizer_config.json (special
    tokens, chat template; chat_template.jinja overrides the config's template), or None when there
    is no tokenizer.json."""
    directory = Path(directory)
    path = directory / TOKENIZER_FILE
    if not path.is_file():
        return None
    config_path = directory / TOKENIZER_CONFIG_FILE
    config = _read_json(config_path) if config_path.is_file() else {}
    if not isinstance(config, dict):
        raise ValueError(f"{config_path}: expected a JSON object, got {type(config).__name__}")
    template_path = directory / CHAT_TEMPLATE_FILE
    template = template_path.read_text(encoding="utf-8") if template_path.is_file() else None
    return HFTokenizer(path, eos_token_ids(directory, cfg_dict), config=config, chat_template=template)


# ------------------------------------------------------------------------------------------------
# Chat templates, rendered as transformers renders them (utils/chat_template_utils.py): a sandboxed
# jinja2 environment with trim_blocks / lstrip_blocks, loop controls, a `tojson` that keeps
# non-ASCII text, `raise_exception` and `strftime_now`; messages with None values dropped.
# ------------------------------------------------------------------------------------------------

def is_conversation(prompt: Any) -> bool:
    """A chat prompt: a non-empty list of message dicts ({"role": ..., "content": ...})."""
    return isinstance(prompt, (list, tuple)) and bool(prompt) and all(isinstance(m, Mapping) for m in prompt)


def render_chat(template: str, messages: list[dict], *, add_generation_prompt: bool = True,
                **template_vars: Any) -> str:
    """Render chat messages to prompt text with a jinja2 chat template. template_vars become template
    variables (bos_token, eos_token, tools, documents, enable_thinking, ...); tools and documents
    default to None as in transformers."""
    import jinja2

    if not is_conversation(messages):
        raise ChatTemplateError(f"chat messages must be a non-empty list of dicts with 'role' and 'content'; "
                                f"got {messages!r}")
    for i, message in enumerate(messages):
        if not isinstance(message.get("role"), str):
            raise ChatTemplateError(f"message {i} ({dict(message)!r}) needs a 'role' string, e.g. 'user'")
    messages = [{key: value for key, value in m.items() if value is not None} for m in messages]
    template_vars = {"tools": None, "documents": None, **template_vars}
    try:
        return _compile_template(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                  **template_vars)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template failed: {e}") from None


@functools.lru_cache(maxsize=16)
def _compile_template(template: str):
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker) renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        from datetime import datetime

        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template has a syntax error at line {e.lineno}: {e.message}") from None


def _config_template(config: dict) -> str | None:
    """tokenizer_config.json's chat_template: a string, or a list of {"name", "template"} (the
    "default" one is used)."""
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None
