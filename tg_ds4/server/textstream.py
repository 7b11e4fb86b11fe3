"""Token ids -> final text: UTF-8-safe detokenizing (StreamDecoder), stop strings cut out with no partial match ever
emitted, and (when tools are offered) everything from the first tool-call marker on captured instead of streamed."""
from __future__ import annotations

from tg_ds4.text.tokenizer import StreamDecoder, Tokenizer


class Holdback:
  """Finds the first of `markers` in streamed text. feed() returns the text that is safe to emit and, on a hit, the marker
  with whatever followed it; a tail that could still grow into a marker is held back until it can't."""
  def __init__(self, markers: list[str]):
    self.markers, self.buf = [m for m in markers if m], ""

  def feed(self, text: str) -> tuple[str, str | None]:
    buf = self.buf + text
    hits = [(i, m) for m in self.markers if (i := buf.find(m)) >= 0]
    if hits:
      i, _ = min(hits)
      self.buf = ""
      return buf[:i], buf[i:]
    keep = max((k for m in self.markers for k in range(min(len(m) - 1, len(buf)), 0, -1) if buf.endswith(m[:k])), default=0)
    self.buf = buf[len(buf) - keep:]
    return buf[:len(buf) - keep], None

  def flush(self) -> str:
    out, self.buf = self.buf, ""
    return out

class TextStream:
  """feed(token) -> (text to emit now, stopped by a stop string?). After the end, flush() returns the rest.
  `captured` is the text from the first tool-call marker on (None when there was none): it is parsed, not streamed."""
  def __init__(self, tok: Tokenizer, stop: list[str], tool_markers: list[str] = ()):
    self.dec, self.stop = StreamDecoder(tok), Holdback(stop)
    self.tools = Holdback(list(tool_markers)) if tool_markers else None
    self.captured: str | None = None
    self.stopped_by: str | None = None  # the stop string that ended the text

  def feed(self, token: int) -> tuple[str, bool]: return self._push(self.dec.feed(token), final=False)

  def flush(self) -> str: return self._push(self.dec.flush(drop_incomplete=True), final=True)[0]  # no U+FFFD for a cut character

  def _push(self, text: str, final: bool) -> tuple[str, bool]:
    if self.stopped_by is not None: return "", True
    out, rest = self.stop.feed(text)
    if rest is not None: self.stopped_by = next(m for m in self.stop.markers if rest.startswith(m))
    elif final: out += self.stop.flush()
    if self.captured is not None:
      self.captured += out
      return "", rest is not None
    if self.tools:
      out, call = self.tools.feed(out)
      if call is not None: self.captured = call
      elif final or rest is not None: out += self.tools.flush()
    return out, rest is not None
