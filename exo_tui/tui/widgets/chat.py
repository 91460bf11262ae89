"""The chat pane: streams answers, shows them as Markdown, keeps a prompt history, and never
blocks the UI.

An answer is one widget, whatever its length: plain text while it streams (redrawn at most every
``FLUSH_S``, a page at a time: see :class:`Answer`), then Rich's Markdown of the whole text when
it ends. Textual's ``Markdown`` widget makes a widget of every paragraph and list item, and the
console lays all of them out again whenever the answer below them grows: streamed that way, a
512-token list of capitals came at 15 tok/s where ``exo-tui chat`` gives 260 (the console's event
loop also runs the coordinator it embeds), and with those widgets kept for finished answers the
fifth such answer came at 28 tok/s.
``esc`` stops generation and keeps what came so far. The log is anchored to the bottom only until
the user scrolls up to read. Errors become notifications and the prompt comes back into the input.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time

from rich.markdown import Markdown as RichMarkdown
from rich.text import Text
from textual import on
from textual.containers import Vertical, VerticalScroll
from textual.timer import Timer
from textual.widgets import Input, Static
from textual.worker import Worker

from exo_tui.cluster.view import ChatChunk, ChatParams
from exo_tui.tui import keymap
from exo_tui.tui.owner import exo_app
from exo_tui.tui.widgets.style import theme_style

log = logging.getLogger("exo_tui.tui")

_CHAT_KEYS = {k.id: k for k in keymap.specs("chat")}
FLUSH_S = 0.1  # the answer on screen trails the tokens by at most this (10 screen updates a second)
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")


def keep_line_breaks(text: str) -> str:
    """``text`` with each line break inside a paragraph made a hard break (two trailing spaces).

    Markdown joins the lines of a paragraph into one, which a model does not mean: a poem, an
    address or a step-by-step answer lost its lines when it ended (and the plain text it streamed
    as had shown them). Fenced code is left as it is; a blank line still ends a paragraph."""
    lines = text.split("\n")
    fence = ""
    for i, line in enumerate(lines[:-1]):
        opened = _FENCE.match(line)
        if not fence and opened:
            fence = opened.group(1)
        elif fence and opened and opened.group(1)[0] == fence[0] and len(opened.group(1)) >= len(fence):
            fence = ""
        elif not fence and line.strip() and lines[i + 1].strip() and not line.endswith(("  ", "\\")):
            lines[i] = line + "  "
    return "\n".join(lines)


class ChatInput(Input):
    """The prompt line; ↑/↓ walk the prompt history.

    Its placeholder says how to get here while another pane has the keys: the console starts on
    the nodes table, where letters are commands (``a`` adds a host), so a question typed straight
    away would run them."""

    HELP_SCOPE = "chat"
    BINDINGS = [_CHAT_KEYS["exo.chat.history_prev"].binding(), _CHAT_KEYS["exo.chat.history_next"].binding()]
    PLACEHOLDER = "Ask the cluster…  enter sends · esc stops · ↑ history"
    PLACEHOLDER_AWAY = "press c to chat (tab moves between panes)"

    def __init__(self, **kwargs) -> None:
        kwargs.setdefault("placeholder", self.PLACEHOLDER_AWAY)
        super().__init__(**kwargs)
        self.history: list[str] = []
        self._index = 0
        self._draft = ""

    def on_focus(self) -> None:
        self.placeholder = self.PLACEHOLDER

    def on_blur(self) -> None:
        self.placeholder = self.PLACEHOLDER_AWAY

    def remember(self, prompt: str) -> None:
        if prompt and (not self.history or self.history[-1] != prompt):
            self.history.append(prompt)
        self._index = len(self.history)
        self._draft = ""

    def action_history(self, step: int) -> None:
        if not self.history:
            return
        if self._index == len(self.history):
            self._draft = self.value
        self._index = max(0, min(len(self.history), self._index + step))
        self.value = self.history[self._index] if self._index < len(self.history) else self._draft
        self.cursor_position = len(self.value)


class UserMessage(Static):
    pass


class Answer(Vertical):
    """One assistant answer: its body (the text as it streams, its Markdown once finished) and
    its status line.

    A streaming answer must not change the layout at every redraw: laying the console out again
    and drawing the whole chat log each time the text grew a line took the console ~30 % of a
    core, taken from the node computing beside it on a small machine (a 2,000-token answer came at
    ~118 tok/s in the console where ``exo-tui chat`` gives ~150). So the body's height grows
    ``STEP_LINES`` lines at a time, the text written into the room ahead; and once it holds more
    than a page of complete lines (``PART_LINES``, or what the log shows), they are set in a part
    of their own above the body, never drawn again, and the body starts over. The layout changes
    every few lines, and a redraw wraps at most a page (~148 tok/s; the console's CPU 5.5 -> 3 s)."""

    PART_LINES = 20
    STEP_LINES = 5

    def __init__(self) -> None:
        super().__init__()
        self.body = Static("", classes="answer-body", markup=False)
        self.status = Static("…", classes="answer-status")
        self.text = ""
        self._parted = 0  # how much of the text the parts above the body hold (with the line break after)

    def compose(self):
        yield self.body
        yield self.status

    @property
    def finished(self) -> bool:
        return isinstance(self.body.content, RichMarkdown)

    def show_streamed(self, room: int = PART_LINES + 3) -> None:
        """The text so far, plain. ``room``: how many lines of the log are on screen (a page, the
        body's margin and the status line fit in it)."""
        page = max(1, min(self.PART_LINES, room - 3))
        tail = self.text[self._parted:]
        if tail.count("\n") > page:
            cut = tail.rfind("\n")
            self.mount(Static(Text(tail[:cut]), classes="answer-part", markup=False), before=self.body)
            self._parted += cut + 1
            tail = tail[cut + 1:]
        lines = tail.count("\n") + 1
        self.body.styles.min_height = min(page + 1, -(-(lines + 1) // self.STEP_LINES) * self.STEP_LINES)
        self.body.update(Text(tail))

    def finish(self, dark: bool = True) -> None:
        """The whole text as Markdown, in place of the plain parts (its line breaks kept)."""
        self.query(".answer-part").remove()
        self._parted = 0
        self.body.styles.min_height = None
        self.body.update(RichMarkdown(keep_line_breaks(self.text), code_theme="monokai" if dark else "friendly"))


class ChatPane(Vertical):
    ALLOW_MAXIMIZE = True
    HELP_SCOPE = "chat"
    BINDINGS = [
        _CHAT_KEYS["exo.chat.stop"].binding(),
        _CHAT_KEYS["exo.chat.clear"].binding(),
        _CHAT_KEYS["exo.chat.page_up"].binding(),
        _CHAT_KEYS["exo.chat.page_down"].binding(),
    ]

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.messages: list[dict[str, str]] = []
        self.params = ChatParams()
        self._worker: Worker | None = None
        self.border_title = "Chat"

    def compose(self):
        log = VerticalScroll(id="chat-log")
        log.can_focus = False  # tab goes to the prompt; pageup/pagedown scroll the answers
        yield log
        yield ChatInput(id="chat-input")

    @property
    def log_view(self) -> VerticalScroll:
        return self.query_one("#chat-log", VerticalScroll)

    @property
    def prompt_input(self) -> ChatInput:
        return self.query_one(ChatInput)

    @property
    def streaming(self) -> bool:
        return self._worker is not None and not self._worker.is_finished

    @on(Input.Submitted, "#chat-input")
    async def _submitted(self, event: Input.Submitted) -> None:
        event.stop()
        prompt = event.value.strip()
        if not prompt:
            return
        if prompt.startswith(":") and keymap.parse_command(prompt)[0] in keymap.COMMANDS:
            # ":set temperature 0" typed here is a command, not a question for the model
            self.prompt_input.remember(prompt)
            self.prompt_input.value = ""
            exo_app(self).run_command(prompt)
            return
        if self.streaming:
            self.notify("An answer is still streaming: esc stops it.", severity="warning")
            return
        await self.send(prompt)

    async def send(self, prompt: str) -> Worker:
        """Show the prompt and start streaming its answer (returns the worker)."""
        self.prompt_input.remember(prompt)
        self.prompt_input.value = ""
        user = UserMessage(Text(prompt), classes="user-message")
        answer = Answer()
        await self.log_view.mount_all([user, answer])
        self.log_view.anchor()
        self._worker = self.run_worker(self._stream(prompt, user, answer), exclusive=True, group="chat")
        return self._worker

    async def _stream(self, prompt: str, user: UserMessage, answer: Answer) -> None:
        app = self.app
        control = exo_app(self).control
        messages = [*self.messages, {"role": "user", "content": prompt}]
        final: ChatChunk | None = None
        error = ""
        cancelled = False
        started = time.monotonic()
        first_token_s: float | None = None
        completion = 0
        agen = control.chat(messages, self.params)
        last_flush = 0.0
        trailing: Timer | None = None  # shows what came after the last update if no token follows it

        def flush() -> None:
            nonlocal last_flush, trailing
            if trailing is not None:
                trailing.stop()
                trailing = None
            if not answer.finished:
                answer.show_streamed(self.log_view.size.height)
            last_flush = time.monotonic()

        try:
            async for chunk in agen:
                if getattr(chunk, "queued_ahead", None) is not None:  # waiting for the cluster's memory
                    answer.status.update(Text(f"queued ({chunk.queued_ahead} ahead)", style=theme_style(app, "foreground-muted")))
                    continue
                if chunk.text:
                    now = time.monotonic()
                    if first_token_s is None:
                        first_token_s = now - started
                    answer.text += chunk.text
                    # at most FLUSH_S between screen updates, however fast the tokens come, and
                    # the last tokens before a pause (a node failing over) shown when it is due
                    if now - last_flush >= FLUSH_S:
                        flush()
                    elif trailing is None:
                        trailing = self.set_timer(FLUSH_S - (now - last_flush), flush)
                completion += len(chunk.token_ids)
                if chunk.finish_reason:
                    final = chunk
                    if chunk.finish_reason == "error" or chunk.error:
                        error = chunk.error or "generation failed"
                    break
        except asyncio.CancelledError:
            cancelled = True
        except Exception as exc:  # the cluster said no: show it, give the prompt back
            error = str(exc) or type(exc).__name__
        finally:
            if trailing is not None:
                trailing.stop()
            try:
                await agen.aclose()
            except Exception:  # the answer has ended either way; its error, if any, is shown below
                log.warning("the answer's stream failed as it closed", exc_info=True)
        if not answer.is_attached:  # the chat was closed while the answer ended: nothing left to show it in
            return
        answer.finish(dark=app.current_theme.dark)
        if error:
            answer.status.update(Text(f"✗ {error}", style=theme_style(app, "error")))
            self.notify(f"The answer failed: {error}", title="Chat", severity="error", timeout=8)
            if not self.prompt_input.value:
                self.prompt_input.value = prompt
                self.prompt_input.cursor_position = len(prompt)
            if not answer.text:
                await user.remove()
                await answer.remove()
            return
        self.messages = [*messages, {"role": "assistant", "content": answer.text}]
        answer.status.update(self._status_text(final, cancelled, first_token_s, completion, started))

    def _status_text(
        self, final: ChatChunk | None, cancelled: bool, ttft_s: float | None, completion: int, started: float
    ) -> Text:
        app = self.app
        muted = theme_style(app, "foreground-muted")
        t = Text()
        if cancelled or final is None or final.finish_reason == "cancelled":
            t.append("■ stopped · ", theme_style(app, "warning"))
        elif final.finish_reason == "length":
            t.append("… length limit · ", theme_style(app, "warning"))
        if final is not None and final.completion_tokens:
            names = [exo_app(self).node_name(n) for n in final.nodes]
            t.append(
                f"{final.prompt_tokens} prompt · {final.completion_tokens} completion · "
                f"ttft {final.ttft_s * 1000:.0f} ms · {final.tok_per_s:.1f} tok/s",
                muted,
            )
            if final.drafted_tokens:  # speculative decoding: what was drafted and kept
                t.append(f" · drafted {final.drafted_tokens} / accepted {final.accepted_tokens}", muted)
            if names:
                t.append(" · " + " → ".join(names), muted)
        else:
            elapsed = time.monotonic() - started
            ttft = f"ttft {ttft_s * 1000:.0f} ms · " if ttft_s is not None else ""
            t.append(f"{completion} tokens · {ttft}{elapsed:.1f} s", muted)
        return t

    def action_stop(self) -> None:
        if self.streaming and self._worker is not None:
            self._worker.cancel()
        elif self.screen.maximized is not None:
            self.screen.minimize()
        elif hasattr(self.screen, "focus_pane"):
            self.screen.focus_pane("nodes")

    def action_scroll_log(self, pages: int) -> None:
        log = self.log_view
        if pages < 0:
            log.scroll_page_up(animate=False)
        else:
            log.scroll_page_down(animate=False)

    async def action_clear(self) -> None:
        if self.streaming and self._worker is not None:
            self._worker.cancel()
        self.messages = []
        await self.log_view.remove_children()
