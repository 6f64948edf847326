"""`baryon chat`: a conversation with a model in the terminal, in this process.

Each user line is one turn: the whole history goes through the tokenizer's chat template, and the
reply streams out as the engine produces it (one engine step at a time). `/reset` forgets the
history (the system prompt stays), `/exit` or end of input quits, and Ctrl-C stops the reply
being generated without quitting. When stdin is not a terminal (a pipe, a file) there is no
banner or prompt: each input line is a turn and each reply is printed followed by a newline, so
a conversation can be scripted.
"""

from __future__ import annotations

import itertools
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TextIO

from baryon.sampling_params import SamplingParams

COMMANDS = {"/reset": "forget the conversation (the system prompt stays)", "/exit": "quit"}


class ChatSession:
    """A conversation: its messages so far and the engine that answers them."""

    def __init__(self, llm: Any, params: SamplingParams, system: str | None = None) -> None:
        tokenizer = llm.get_tokenizer()
        if tokenizer is None:
            raise ValueError("chat needs a tokenizer; this engine was built with skip_tokenizer_init")
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"the model {llm.config.model.model!r} has no chat template, so it cannot "
                             f"chat; use `baryon generate` for plain completion")
        if params.n != 1:
            raise ValueError(f"chat streams one reply per turn; n={params.n} must be 1")
        self.llm, self.params, self.system = llm, params, system
        self.messages: list[dict[str, str]] = []
        self._request_ids = itertools.count()
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def reply(self, user_text: str, write: Callable[[str], None]) -> str:
        """Answer one user turn, writing the reply's text as it is generated; returns the reply
        (what was shown, when Ctrl-C stopped it early). The turn joins the history."""
        messages = self.messages + [{"role": "user", "content": user_text}]
        prompt_ids = self.llm.get_tokenizer().apply_chat_template(
            messages, tokenize=True, add_generation_prompt=True, return_dict=False)
        engine = self.llm.engine
        request_id = f"chat-{next(self._request_ids)}"
        engine.add_request(request_id, {"prompt_token_ids": list(prompt_ids)}, self.params)
        # A stop string is cut from the text once complete: hold back as much text as could be its start.
        hold = max(map(len, self.params.stop_strings), default=1) - 1
        shown = ""
        with _interrupts_deferred() as interrupted:
            while engine.has_unfinished_requests():
                if interrupted():
                    engine.abort_request([request_id])
                    break
                for output in engine.step():
                    if output.request_id != request_id:
                        continue
                    text = output.outputs[0].text
                    end = len(text) if output.finished else max(len(shown), len(text) - hold)
                    if end > len(shown):
                        write(text[len(shown):end])
                        shown = text[:end]
        self.messages = messages + [{"role": "assistant", "content": shown}]
        return shown


@contextmanager
def _interrupts_deferred() -> Iterator[Callable[[], bool]]:
    """While a reply is generated, the first Ctrl-C only raises a flag that the loop reads between
    engine steps (a step is never cut in half, so the engine stays consistent and the request is
    aborted cleanly); a second Ctrl-C interrupts at once."""
    pressed: list[bool] = []
    if threading.current_thread() is not threading.main_thread():
        yield lambda: False  # signals reach the main thread only
        return

    def on_sigint(signum: int, frame: Any) -> None:
        if pressed:
            raise KeyboardInterrupt
        pressed.append(True)

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield lambda: bool(pressed)
    finally:
        signal.signal(signal.SIGINT, previous)


def run_chat(llm: Any, params: SamplingParams, system: str | None = None,
             stdin: TextIO | None = None, stdout: TextIO | None = None) -> int:
    """The chat loop; returns the exit code (0 at /exit or end of input, 130 after a second Ctrl-C)."""
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    session = ChatSession(llm, params, system)
    interactive = stdin.isatty()

    def write(text: str) -> None:
        stdout.write(text)
        stdout.flush()

    if interactive:
        _enable_line_editing()
        model = llm.config.model.model
        write(f"Chatting with {os.path.basename(model) if os.path.isfile(model) else model}. Commands: "
              + ", ".join(f"{c} ({what})" for c, what in COMMANDS.items())
              + "; Ctrl-C stops a reply, Ctrl-D quits.\n")
    try:
        while (line := _read_turn(stdin, interactive, write)) is not None:
            if line.startswith("/"):
                if line.strip() == "/exit":
                    break
                if line.strip() == "/reset":
                    session.reset()
                    if interactive:
                        write("(conversation reset)\n")
                else:
                    write(f"unknown command {line.split()[0]!r}; commands: {', '.join(COMMANDS)}\n")
                continue
            if not line.strip():
                continue
            try:
                session.reply(line, write)
            except ValueError as e:  # e.g. the history no longer fits in max_model_len
                print(f"baryon chat: error: {e} (/reset starts a new conversation)", file=sys.stderr)
                continue
            write("\n\n" if interactive else "\n")
    except KeyboardInterrupt:  # a second Ctrl-C during a reply
        write("\n")
        return 130
    return 0


def _read_turn(stdin: TextIO, interactive: bool, write: Callable[[str], None]) -> str | None:
    """The next user line (without its newline), or None at end of input."""
    if not interactive:
        line = stdin.readline()
        return line.rstrip("\n") if line else None
    while True:
        try:
            return input("> ") if stdin is sys.stdin else _prompted_readline(stdin, write)
        except EOFError:
            write("\n")
            return None
        except KeyboardInterrupt:  # Ctrl-C at the prompt clears the line, as in a shell
            write("\n(Ctrl-D or /exit quits)\n")


def _prompted_readline(stdin: TextIO, write: Callable[[str], None]) -> str:
    write("> ")
    line = stdin.readline()
    if not line:
        raise EOFError
    return line.rstrip("\n")


def _enable_line_editing() -> None:
    try:
        import readline  # noqa: F401  (input() gains editing and history)
    except ImportError:
        pass
