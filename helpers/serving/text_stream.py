"""Generated tokens to streamed text: what a server may send after each token.

Two things can make text that is already decoded unsafe to send. A token can end partway through a UTF-8 character
(GPT-2's byte-level tokens split characters such as "é" or "日"), so its bytes wait for the rest. And the end of the
text can be the beginning of a stop string that the next tokens complete ("\\nUs" before "er:"), so it waits until
it either becomes the stop string, which is cut together with everything after it, or stops matching.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence


class TextStream:
    """`push(token)` returns the text that is now safe to send; `finish()` the rest, once no token follows.
    `stopped` turns True at the first stop string; the text sent never contains one."""

    def __init__(self, token_bytes: Callable[[int], bytes], stop: Sequence[str] = ()) -> None:
        if any(not s for s in stop):
            raise ValueError("a stop string must not be empty")
        self.token_bytes, self.stop = token_bytes, tuple(stop)
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.held = ""  # decoded text that could begin a stop string
        self.stopped = False

    def push(self, token: int) -> str:
        if self.stopped:
            return ""
        return self._release(self.held + self.decoder.decode(self.token_bytes(token)))

    def finish(self) -> str:
        """The text held back, with the bytes of an unfinished character shown as U+FFFD."""
        if self.stopped:
            return ""
        text = self._release(self.held + self.decoder.decode(b"", final=True), final=True)
        return text

    def _release(self, text: str, final: bool = False) -> str:
        found = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if found:
            self.stopped, self.held = True, ""
            return text[: min(found)]
        keep = 0 if final else max((n for s in self.stop for n in range(1, len(s)) if text.endswith(s[:n])),
                                   default=0)
        self.held = text[len(text) - keep:]
        return text[: len(text) - keep]
