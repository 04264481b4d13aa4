"""Incremental detokenization and stop-string matching at the edge."""
from __future__ import annotations

from pdserve_server.coordinator.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that never split a UTF-8 character.

    The prefix/read offset scheme (as in TGI and vLLM): decode a window that starts a few tokens back, so merges
    and leading spaces come out right, and hold the delta back while it ends in U+FFFD (an incomplete byte
    sequence).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int]):
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-5:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; return the text that became final (possibly "")."""
        self.ids.extend(token_ids)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset:])
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
            # Candidates start where the text has s's first character, within the last len(s) - 1 characters:
            # the earliest that fits is the longest (a find per candidate, not an endswith per length).
            j = text.find(s[0], max(0, len(text) - len(s) + 1))
            while j != -1 and len(text) - j > keep:
                if s.startswith(text[j:]):
                    keep = len(text) - j
                    break
                j = text.find(s[0], j + 1)
        self.held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep], None

    def flush(self) -> str:
        """The held-back text, at the end of the stream (no stop string matched)."""
        out, self.held = self.held, ""
        return out
