"""Tokenization, incremental detokenization and stop-string matching at the edge."""
from __future__ import annotations

from pathlib import Path

from coordinator.errors import invalid
from pdserve.v1 import generate_pb2


class Tokenizer:
    """Wraps the model's HF tokenizer (loaded from the model directory; nothing fetched)."""

    def __init__(self, model_dir: str | Path):
        from transformers import AutoTokenizer

        self.hf = AutoTokenizer.from_pretrained(str(model_dir))

    def encode(self, text: str) -> list[int]:
        return self.hf(text, add_special_tokens=True)["input_ids"]

    def encode_chat(self, chat: generate_pb2.ChatMessages) -> list[int]:
        """Render messages with the model's chat template.

        Raises:
            RequestError: INVALID_ARGUMENT when the template rejects the messages.
        """
        messages = [{"role": m.role, "content": m.content} for m in chat.messages]
        add_gen = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
        try:
            ids = self.hf.apply_chat_template(messages, add_generation_prompt=add_gen, tokenize=True)
        except Exception as e:  # jinja errors from the template ("roles must alternate", ...)
            raise invalid(f"chat template rejected the messages: {e}") from e
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def token_text(self, token_id: int) -> str:
        return self.hf.decode([token_id])


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that never split a UTF-8 character.

    The prefix/read offset scheme (as in TGI and vLLM): decode a window that starts a few tokens back, so merges
    and leading spaces come out right, and hold the delta back while it ends in U+FFFD (an incomplete byte
    sequence).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int]):
        self.hf = tokenizer.hf
        self.ids = list(prompt_ids[-5:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def add(self, token_ids: list[int]) -> str:
        self.ids.extend(token_ids)
        prefix = self.hf.decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=True)
        full = self.hf.decode(self.ids[self.prefix_offset:], skip_special_tokens=True)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix):]
        return ""


class StopMatcher:
    """Finds stop strings across chunk boundaries, holding back text that may be the start of one."""

    def __init__(self, stops: list[str], include_stop: bool):
        self.stops = stops
        self.include_stop = include_stop
        self.held = ""

    def feed(self, delta: str) -> tuple[str, str | None]:
        """Returns (text safe to emit, matched stop or None). After a match, nothing more should be fed."""
        text = self.held + delta
        if not self.stops:
            self.held = ""
            return text, None
        best = None
        for s in self.stops:
            i = text.find(s)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            i, s = best
            self.held = ""
            return (text[:i + len(s)] if self.include_stop else text[:i]), s
        keep = 0
        for s in self.stops:  # longest suffix of text that is a proper prefix of a stop string
            for k in range(min(len(s) - 1, len(text)), keep, -1):
                if text.endswith(s[:k]):
                    keep = k
                    break
        self.held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep], None

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out
