"""The model's tokenizer and chat template at the edge, without transformers (which would load torch).

`tokenizers` (HF's Rust tokenizer, the library transformers' fast tokenizers wrap) reads `tokenizer.json`; the chat
template is rendered with jinja2 in the same sandboxed environment transformers uses for `apply_chat_template`
(trim_blocks, lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, a non-escaping `tojson`), then
tokenized without special tokens, as transformers does. tests/test_text.py holds both against transformers.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from coordinator.errors import invalid

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _read_chat_template(model_dir: Path, tokenizer_config: dict) -> str | None:
    """`chat_template.jinja` (transformers >= 4.43 writes it) or tokenizer_config.json's "chat_template" (a string,
    or a list of named templates of which "default" is used)."""
    path = model_dir / "chat_template.jinja"
    if path.is_file():
        return path.read_text()
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template


class Tokenizer:
    """A model directory's tokenizer and chat template (nothing is fetched).

    Args:
        model_dir: HF-format directory with tokenizer.json (and tokenizer_config.json / chat_template.jinja).

    Raises:
        FileNotFoundError: no tokenizer.json in model_dir.
    """

    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        if not (model_dir / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{model_dir} has no tokenizer.json")
        self.hf = HFTokenizer.from_file(str(model_dir / "tokenizer.json"))
        # Longest token in characters: a byte-level BPE token's stored form has a character per byte and a
        # SentencePiece token one per character, so no token decodes to more characters than this.
        self.max_chars_per_token = max(len(t) for t in self.hf.get_vocab(with_added_tokens=True))
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        self.special_tokens = {k: _token_text(config[k]) for k in SPECIAL_TOKEN_KEYS if config.get(k) is not None}
        source = _read_chat_template(model_dir, config)
        self._template = _compile_template(source) if source else None

    def encode(self, text: str) -> list[int]:
        """Token ids of plain text, with the tokenizer's special tokens (e.g. BOS) added as its post-processor says."""
        return self.hf.encode(text, add_special_tokens=True).ids

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """Render [{"role", "content"}, ...] with the model's chat template and tokenize the result.

        Raises:
            RequestError: INVALID_ARGUMENT when the model has no chat template or the template rejects the messages
                (e.g. "roles must alternate", raised by the template itself).
        """
        if self._template is None:
            raise invalid("this model has no chat template; send text or token_ids instead of chat messages")
        try:
            text = self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **self.special_tokens)
        except jinja2.TemplateError as e:
            raise invalid(f"chat template rejected the messages: {e}") from e
        return self.hf.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: list[int]) -> str:
        """Text of token ids, special tokens left out (as shown to users)."""
        return self.hf.decode(token_ids, skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        """One token's text, special tokens included (for logprobs); may be a partial UTF-8 sequence as U+FFFD."""
        return self.hf.decode([token_id], skip_special_tokens=False)


def _token_text(value: str | dict) -> str:
    """tokenizer_config.json writes a special token as a string or as {"content": ..., ...} (an AddedToken)."""
    return value["content"] if isinstance(value, dict) else value
