"""Reasoning in a model's text: `<think>...</think>` split from the answer, streamed or not.

A format is data (`ReasoningFormat`): its two tags, whether an output starts inside the reasoning (DeepSeek-R1's
template opens `<think>` in the prompt, so R1 may never write it), and a tool-call marker that ends the reasoning
without `</think>` (GLM-4.5 and Kimi-K2 may open their calls straight from it; the marker stays in the content for
the tool-call parser). `ReasoningParser` reads any of them with one state machine; `parse` is the same machine fed
the whole text at once, so a stream joined is exactly the one-shot result.

The rules, as SGLang's reasoning parsers apply them: the reasoning opens only at the start of the output (after
blank space; one block); an opening tag there is dropped even where the reasoning starts open; the reasoning is
stripped of blank space at both ends, the content right after `</think>` at its start; an output cut off inside the
reasoning is all reasoning; an output that never opens one is all content, as written.
"""

from dataclasses import dataclass

from jaxdp.api.parsers.markers import find_first, partial_suffix_len

_SPACE = " \t\r\n"


@dataclass(frozen=True)
class ReasoningFormat:
    """One model family's reasoning text, as data the parser reads."""

    name: str  # SGLang's --reasoning-parser name
    starts_open: bool  # the output starts inside the reasoning unless the request says otherwise
    closed_by: str | None = None  # a tool-call marker that also ends the reasoning (and stays in the content)
    begin: str = "<think>"
    end: str = "</think>"


@dataclass(frozen=True)
class ReasoningSplit:
    """A whole output (or one delta's part of it) split: OpenAI's `reasoning_content` and `content`."""

    reasoning_content: str
    content: str


_START, _REASONING, _CONTENT = range(3)


class ReasoningParser:
    """Splits one output's reasoning from its content: `feed` each text delta, then `finish` once; or `parse` a
    whole text. `starts_open` overrides the format's rule for this request (DeepSeek-V3.1's template opens
    `<think>` in the prompt when the request turns thinking on: pass True then)."""

    def __init__(self, fmt: ReasoningFormat, *, starts_open: bool | None = None):
        self.format = fmt
        self.starts_open = fmt.starts_open if starts_open is None else starts_open
        self._state = _START
        self._buffer = ""
        self._reasoning_started = False  # reasoning text has been sent: blank space inside it is kept
        self._strip_content = False
        self._finished = False
        self._markers = tuple(m for m in (fmt.end, fmt.closed_by) if m)
        self._out_reasoning: list[str] = []
        self._out_content: list[str] = []

    def parse(self, text: str) -> ReasoningSplit:
        """The split of a whole text (a fresh parser of the same settings reads it; this one is left as it is)."""
        fresh = ReasoningParser(self.format, starts_open=self.starts_open)
        first, last = fresh.feed(text), fresh.finish()
        return ReasoningSplit(first.reasoning_content + last.reasoning_content, first.content + last.content)

    def feed(self, delta: str) -> ReasoningSplit:
        """What this delta decides (text that may still be a tag, or blank space before one, is held back)."""
        if self._finished:
            raise RuntimeError("this ReasoningParser has finished; make a new one for the next output")
        self._buffer += delta
        while self._step(final=False):
            pass
        return self._take()

    def finish(self) -> ReasoningSplit:
        """What was held back at the end of the output."""
        if not self._finished:
            self._finished = True
            while self._step(final=True):
                pass
        return self._take()

    def _take(self) -> ReasoningSplit:
        split = ReasoningSplit("".join(self._out_reasoning), "".join(self._out_content))
        self._out_reasoning, self._out_content = [], []
        return split

    def _reason(self, text: str) -> None:
        if not self._reasoning_started:
            text = text.lstrip(_SPACE)
        if text:
            self._reasoning_started = True
            self._out_reasoning.append(text)

    def _step(self, final: bool) -> bool:
        if self._state == _START:
            rest = self._buffer.lstrip(_SPACE)
            begin = self.format.begin
            if rest.startswith(begin):
                self._buffer = rest[len(begin) :]
                self._state = _REASONING
                return True
            if not final and begin.startswith(rest):
                return False
            self._state = _REASONING if self.starts_open else _CONTENT
            return True
        if self._state == _REASONING:
            hit = find_first(self._buffer, self._markers, final)
            if hit is None:
                if final:
                    self._reason(self._buffer.rstrip(_SPACE))
                    self._buffer = ""
                    return False
                held = len(self._buffer) - partial_suffix_len(self._buffer, self._markers)
                sent = self._buffer[:held].rstrip(_SPACE)
                self._reason(sent)
                self._buffer = self._buffer[len(sent) :]
                return False
            index, marker = hit
            self._reason(self._buffer[:index].rstrip(_SPACE))
            if marker == self.format.end:
                self._buffer = self._buffer[index + len(marker) :]
                self._strip_content = True
            else:
                self._buffer = self._buffer[index:]
            self._state = _CONTENT
            return True
        text = self._buffer
        if self._strip_content:
            text = text.lstrip(_SPACE)
            if not text:
                self._buffer = ""
                return False
            self._strip_content = False
        if text:
            self._out_content.append(text)
        self._buffer = ""
        return False
