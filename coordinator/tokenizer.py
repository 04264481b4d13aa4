"""The model's tokenizer and chat template at the edge, without transformers (which would load torch).

`tokenizers` (HF's Rust tokenizer, the library transformers' fast tokenizers wrap) reads `tokenizer.json`; the chat
template is rendered with jinja2 in the same sandboxed environment transformers uses for `apply_chat_template`
(trim_blocks, lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, a non-escaping `tojson`), then
tokenized without special tokens, as transformers does. tests/coordinator/test_text.py holds both against transformers.

One difference on purpose: special-token text inside a message's content ("<|im_start|>system ...") is encoded as
ordinary text unless the caller asks otherwise, so a user message cannot forge a turn of another role (transformers
would parse it into control tokens).
"""
from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from pdserve_server.coordinator.errors import invalid

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
# Stand-ins for message contents while the template renders (Unicode private-use characters).
_SLOT = "\ue000{}\ue001"
_SLOT_RE = re.compile("\ue000(\\d+)\ue001")


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
        # A twin that encodes special-token text as ordinary text (for chat contents).
        self._literal = HFTokenizer.from_str(self.hf.to_str())
        self._literal.encode_special_tokens = True
        self._special_texts = [t.content for t in self.hf.get_added_tokens_decoder().values() if t.special]
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

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                    parse_special_tokens: bool = False) -> list[int]:
        """Render [{"role", "content"}, ...] with the model's chat template and tokenize the result.

        Unless parse_special_tokens, special-token text inside a content is encoded as ordinary text: the template
        is rendered with stand-ins for the contents, its own text is encoded with special tokens and each content
        without. Contents without special-token text take the single-pass encoding (transformers' ids).

        Raises:
            RequestError: INVALID_ARGUMENT when the model has no chat template or the template rejects the messages
                (e.g. "roles must alternate", raised by the template itself).
        """
        if parse_special_tokens or not any(s in m["content"] for m in messages for s in self._special_texts):
            return self.hf.encode(self._render(messages, add_generation_prompt), add_special_tokens=False).ids
        slotted = [{**m, "content": _SLOT.format(i)} for i, m in enumerate(messages)]
        parts = _SLOT_RE.split(self._render(slotted, add_generation_prompt))  # template, index, template, ...
        ids: list[int] = []
        for i, part in enumerate(parts):
            if i % 2:
                ids += self._literal.encode(messages[int(part)]["content"], add_special_tokens=False).ids
            elif part:
                ids += self.hf.encode(part, add_special_tokens=False).ids
        return ids

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        if self._template is None:
            raise invalid("this model has no chat template; send text or token_ids instead of chat messages")
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **self.special_tokens)
        except jinja2.TemplateError as e:
            raise invalid(f"chat template rejected the messages: {e}") from e

    def decode(self, token_ids: list[int]) -> str:
        """Text of token ids, special tokens left out (as shown to users)."""
        return self.hf.decode(token_ids, skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        """One token's text, special tokens included (for logprobs); may be a partial UTF-8 sequence as U+FFFD."""
        return self.hf.decode([token_id], skip_special_tokens=False)


def _token_text(value: str | dict) -> str:
    """tokenizer_config.json writes a special token as a string or as {"content": ..., ...} (an AddedToken)."""
    return value["content"] if isinstance(value, dict) else value
