"""Token ids to text while they stream, one token at a time.

A byte-level token can hold part of a UTF-8 character (an emoji is often two or three tokens),
so text is emitted only once its characters are complete. Each token costs O(its bytes): the
history is never decoded again. The concatenation of everything :meth:`add` and :meth:`flush`
return equals ``tokenizer.decode(ids, skip_special=...)`` of all ids fed.
"""

from __future__ import annotations

import codecs

from exo_tui.models.tokenizer import Tokenizer


class StreamingDetokenizer:
    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = True) -> None:
        """``skip_special``: control tokens (``<|im_start|>``, EOS) add no text, as in
        llama.cpp's server; pass ``False`` to see them."""
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._first = True
        self.tokens = 0  # how many ids were fed

    def add(self, token_id: int) -> str:
        """Feed one token id; return the text that became complete (often ``""`` mid-character)."""
        self.tokens += 1
        tok = self.tokenizer
        if self.skip_special and tok.is_special(token_id):
            return ""
        piece = tok.token_bytes(token_id)
        if self._first:
            self._first = False
            if tok.strip_leading_space and piece.startswith(b" "):
                piece = piece[1:]
        return self._decoder.decode(piece)

    def flush(self) -> str:
        """The end of the stream: bytes still held (an unfinished character) come out as U+FFFD."""
        return self._decoder.decode(b"", final=True)

    @property
    def pending_bytes(self) -> int:
        """Bytes held back because they start a character that is not complete yet."""
        return len(self._decoder.getstate()[0])
