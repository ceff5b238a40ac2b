"""What native libraries write straight to stderr (file descriptor 2, below Python's
`sys.stderr`, so neither logging nor pytest's capsys sees it), kept out of the user's
terminal and the server's log: KenLM's loading messages and progress bar."""

from __future__ import annotations

import os
import re
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_LOCK = threading.Lock()  # one redirection at a time: fd 2 is the process's

# KenLM's ARPA loader (through flashlight-text): a hint to build a binary file (no tool
# here builds one: docs/transcribing.md, "A language model"), the path, then a 100-column
# progress bar.
KENLM_CHATTER = re.compile(
    r"Loading the LM will be faster if you build a binary file\.|Reading .*|"
    r"-+5-+10-+15.*|\*+"
)


@contextmanager
def quiet_stderr(chatter: re.Pattern[str]) -> Iterator[None]:
    """For the block, fd 2 writes to a temporary file; afterwards the lines that are
    `chatter` (whole lines, by fullmatch) are dropped and the rest (a real error, another
    thread's log line) written to fd 2 as they came, so nothing but the chatter is lost."""
    with _LOCK, tempfile.TemporaryFile() as held:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = [
                line
                for line in held.read().splitlines(keepends=True)
                if not chatter.fullmatch(line.decode(errors="replace").strip())
            ]
            if kept:
                os.write(2, b"".join(kept))
