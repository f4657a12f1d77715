"""What long work says while it runs, on stderr: a bar on a terminal, plain lines elsewhere.

An ``image save`` of a CUDA image or the hashing of 62 GB of weights takes a minute or more; a
command silent for that long looks hung. :func:`meter` shows one piece of such work by its size:

- on a terminal, a tqdm bar that says what and how much (``saving gemma4-vllm:0.32.0-mtp
  1.20G/2.94G [00:20<00:29, 60.0MB/s]``), the same bars ``huggingface_hub`` draws for a download;
- in a pipe or the journal (stderr not a terminal), a plain line when the work starts and one
  every :data:`EVERY` seconds while it runs (``saving ...: 1.20 of 2.94 GB (41%), 20 s``): no
  ``\\r``, no escape codes, a line a log keeps;
- nothing at all at :data:`QUIET` (the group's ``-q``), where only results and errors print.

:func:`line` prints one line at a level (``error``, ``warning``, ``info``); under systemd, when
stderr is the journal's stream, a line carries its syslog priority as the ``<3>``/``<4>`` prefix
that ``SyslogLevelPrefix=`` (on by default) reads, so ``journalctl -p warning`` finds it.

The verbosity is the process's (:func:`set_verbosity`, from the command line's ``-q``/``-v``);
the library calls :func:`meter` and :func:`line` and never asks who runs it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from typing import TextIO

QUIET, NORMAL, VERBOSE = -1, 0, 1
EVERY = 10.0  # seconds between two plain progress lines

_verbosity = NORMAL

# sd-daemon(3)'s priority prefixes, as the journal reads them from a stream.
_PRIORITY = {"error": "<3>", "warning": "<4>", "notice": "<5>", "info": "<6>", "debug": "<7>"}


def set_verbosity(level: int) -> None:
    """The process's verbosity: :data:`QUIET`, :data:`NORMAL` or :data:`VERBOSE` (clamped)."""
    global _verbosity
    _verbosity = max(QUIET, min(VERBOSE, int(level)))


def verbosity() -> int:
    return _verbosity


def _stream(stream: TextIO | None) -> TextIO:
    return stream if stream is not None else sys.stderr


def is_journal(stream: TextIO | None = None) -> bool:
    """Whether ``stream`` (default stderr) is the journal's: systemd sets ``JOURNAL_STREAM`` to
    ``DEVICE:INODE`` of the stream it connected; a redirect below the unit (``2>file``) keeps
    the variable but not the stream, so both are compared."""
    value = os.environ.get("JOURNAL_STREAM", "")
    dev, _, ino = value.partition(":")
    try:
        st = os.fstat(_stream(stream).fileno())
        return (st.st_dev, st.st_ino) == (int(dev), int(ino))
    except (ValueError, OSError, AttributeError):
        return False


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def journal_prefix(level: str, stream: TextIO | None = None) -> str:
    """``<3>`` for an error line, ``<4>`` for a warning... when ``stream`` (default stderr) is
    the journal's; ``""`` anywhere else."""
    return _PRIORITY.get(level, "") if is_journal(stream) else ""


def line(text: str, level: str = "info", stream: TextIO | None = None) -> None:
    """Print ``text`` on stderr at ``level`` (error, warning, notice, info, debug): with its
    priority prefix when stderr is the journal; info and below not at all when quiet, debug
    only when verbose."""
    if level == "debug" and _verbosity < VERBOSE:
        return
    if level in ("info", "notice") and _verbosity <= QUIET:
        return
    out = _stream(stream)
    out.write(f"{journal_prefix(level, out)}{text}\n")
    out.flush()


def size(n: float) -> str:
    """Bytes as the CLI prints them: ``2.94 GB``, ``812.3 MB``."""
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


class Meter:
    """One piece of work of ``total`` bytes (None: not known ahead); :meth:`update` as it goes."""

    def __init__(
        self, what: str, total: int | None, stream: TextIO | None = None, *, every: float = EVERY
    ) -> None:
        self.what, self.total, self.every = what, total, every
        self.done = 0
        self._out = _stream(stream)
        self._started = self._last = time.monotonic()
        self._bar = None
        if _verbosity <= QUIET:
            self.mode = "quiet"
        elif _is_terminal(self._out):
            self.mode = "bar"
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=total,
                desc=what,
                unit="B",
                unit_scale=True,
                unit_divisor=1000,
                file=self._out,
                dynamic_ncols=True,
                leave=True,
            )
        else:
            self.mode = "lines"
            whole = f": {size(total)}" if total else ""
            self._print(f"{what}{whole}")

    def _print(self, text: str) -> None:
        self._out.write(text + "\n")
        self._out.flush()

    def update(self, n: int) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
        elif self.mode == "lines":
            now = time.monotonic()
            if now - self._last >= self.every:
                self._last = now
                self._print(f"{self.what}: {self._so_far()}, {now - self._started:.0f} s")

    def _so_far(self) -> str:
        if not self.total:
            return size(self.done)
        pct = min(100, int(100 * self.done / self.total))
        scale, unit = (1e9, "GB") if self.total >= 1e9 else (1e6, "MB")
        digits = 2 if unit == "GB" else 1
        return f"{self.done / scale:.{digits}f} of {size(self.total)} ({pct}%)"

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


@contextlib.contextmanager
def meter(what: str, total: int | None, stream: TextIO | None = None) -> Iterator[Meter]:
    """A :class:`Meter` for the ``with`` block; its bar closed however the block ends."""
    m = Meter(what, total, stream)
    try:
        yield m
    finally:
        m.close()


def hub_bars_off() -> bool:
    """Whether ``huggingface_hub``'s own download bars would be noise: quiet, or stderr not a
    terminal (there they are ``\\r``-joined frames in one log line)."""
    return _verbosity <= QUIET or not _is_terminal(sys.stderr)
