"""Progress while a suite runs: a rich bar on a terminal, plain lines otherwise (logs, CI, remote runs)."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int, title: str, *, quiet: bool = False):
        self.total, self.done, self.quiet = total, 0, quiet
        self._bar = None
        self._start = time.perf_counter()
        if quiet:
            return
        if sys.stdout.isatty():
            try:
                from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
                from rich.progress import Progress as RichProgress
            except ImportError:
                pass
            else:
                self._bar = RichProgress(
                    TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()
                )
                self._task = self._bar.add_task(title, total=total)
                self._bar.start()
                return
        print(f"{title}: {total} provider x case runs", flush=True)

    def step(self, line: str) -> None:
        self.done += 1
        if self.quiet:
            return
        text = f"[{self.done:>{len(str(self.total))}}/{self.total}] {line}"
        if self._bar is not None:
            self._bar.console.print(text, markup=False, highlight=False)
            self._bar.advance(self._task)
        else:
            # a log has no live clock: the elapsed time shows which provider x case took long (compilations)
            print(f"{text}  (+{time.perf_counter() - self._start:.0f} s)", flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
