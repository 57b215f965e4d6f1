"""The text of a request's tokens, as they come: incremental detokenization and stop strings.

Decoding each new token alone would lose what tokenizers do across tokens (spaces between
WordPiece words, UTF-8 characters split over byte-level BPE tokens), and decoding the whole
sequence every step costs its length. So each step decodes a short window: the tokens since the
last text emitted, after the token before them, whose text is known, and emits what the new
tokens added, unless it ends in an unfinished character (U+FFFD). Stop strings end the text before
their first occurrence; while the text ends with the start of one, that end is held back.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

INCOMPLETE_CHARACTER = "\ufffd"


class TextStream:
    """The text of one request's new tokens.

    Args:
        tokenizer (`PreTrainedTokenizerBase`): decodes the tokens (special tokens left out).
        stop (`list[str]`): the text ends before the first occurrence of any of them.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = [text for text in stop if text]
        self.tokens: list[int] = []
        self._window = 0  # the first token of the decoding window: one whose text is known
        self._read = 0  # the tokens before it have been turned into text
        self.text = ""  # all the text so far
        self.emitted = 0  # how much of it was given out
        self.stopped = False  # a stop string was met: `text` ends before it

    def add(self, token: int) -> str:
        """Takes the next token; returns the text it releases (maybe none)."""
        self.tokens.append(token)
        known = self._decode(self.tokens[self._window:self._read])
        new = self._decode(self.tokens[self._window:])
        if len(new) > len(known) and not new.endswith(INCOMPLETE_CHARACTER):
            self.text += new[len(known):]
            self._window, self._read = self._read, len(self.tokens)
        return self._release(final=False)

    def finish(self) -> str:
        """At the end of the request: the text still held back (the start of a stop string that
        did not come)."""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        found = [index for index in (self.text.find(stop) for stop in self.stop) if index >= 0]
        if found:
            self.text, self.stopped = self.text[: min(found)], True
            end = len(self.text)
        elif final:
            end = len(self.text)
        else:  # hold back an end of the text that may be the start of a stop string
            end = len(self.text) - max((length for stop in self.stop for length in range(1, len(stop))
                                        if self.text.endswith(stop[:length])), default=0)
        released, self.emitted = self.text[self.emitted:end], max(self.emitted, end)
        return released

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)
