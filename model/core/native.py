"""What native libraries write straight to stderr (file descriptor 2, below Python's
`sys.stderr`, so neither logging nor pytest's capsys sees it), kept out of the user's
terminal and the server's log: KenLM's loading messages and progress bar
(`quiet_stderr`, around the load), and libmpg123's notes on a damaged MP3
(`drop_stdio_chatter`, for the whole of an `echoic` process).

Why two ways. KenLM loads once, so fd 2 can be swapped for the load, under a lock. MP3s are
decoded by several threads at once in the server, all the time: holding one process-wide
lock across every decode would make MP3 requests wait for each other, and swapping fd 2
meanwhile would hold back every other thread's log lines. libmpg123 (inside libsndfile;
it has no switch libsndfile sets, nor an environment variable, for its `MPG123_QUIET`)
prints through C's stdio `stderr`, not fd 2 itself: so that one FILE is pointed at a pipe,
once, whose lines a thread passes on to fd 2 unless they are mpg123's. Nothing else
changes: Python's own output, faulthandler, child processes and C++'s std::cerr (which
holds the FILE it found at start) write to fd 2 as before and never wait on that thread.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import platform
import re
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_LOCK = threading.Lock()  # one redirection at a time: fd 2 is the process's

# KenLM's ARPA loader (through flashlight-text): a hint to build a binary file (the
# bundled model ships one, lm.bin, which loads without a word; scripts/build_lm_binary.sh
# makes one of a user's ARPA file), the path, then a 100-column progress bar.
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


# libmpg123's notes on damaged input: resyncs, skipped bytes, a Xing header that disagrees,
# and its "[src/libmpg123/layer3.c:...] error: ..." lines (the decode goes on, or libsndfile
# reports the error the caller sees). A 5 s MP3 with 700 zero bytes inserted 100 times
# printed 296 such lines: a hostile upload's lines would otherwise flood the server's log.
MPG123_CHATTER = re.compile(r"(Note|Warning): .*|\[src/libmpg123/.*")

_relay: threading.Thread | None = None  # drop_stdio_chatter's thread, once started


def drop_stdio_chatter(chatter: re.Pattern[str] = MPG123_CHATTER) -> bool:
    """From now on, in this process: C's stdio `stderr` writes to a pipe whose lines a
    daemon thread writes to fd 2 as they come, except those that are `chatter` (whole lines,
    by fullmatch). Once per process (later calls do nothing); returns whether it is on.
    glibc only (elsewhere `stderr` may be read-only): off on other platforms. A line from
    C now arrives a moment later, so it can fall between two writes of one Python print()
    (text, then its newline); a log record is one write and stays whole."""
    global _relay
    if _relay is not None:
        return True
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    libc.fdopen.restype = ctypes.c_void_p
    libc.fdopen.argtypes = [ctypes.c_int, ctypes.c_char_p]
    libc.setvbuf.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_size_t]
    libc.fflush.argtypes = [ctypes.c_void_p]
    read, write = os.pipe()  # close-on-exec: programs this process starts keep fd 2
    stream = libc.fdopen(write, b"w")
    if not stream:
        os.close(read)
        os.close(write)
        return False
    libc.setvbuf(stream, None, 1, 0)  # _IOLBF: each line reaches the pipe at once
    _relay = threading.Thread(
        target=_pass_on, args=(read, chatter), name="echoic-stderr", daemon=True
    )
    _relay.start()
    c_stderr = ctypes.c_void_p.in_dll(libc, "stderr")
    previous = c_stderr.value
    libc.fflush(previous)
    c_stderr.value = stream
    atexit.register(_drain, libc, c_stderr, previous, stream)
    return True


# What `_drain` writes through C's `stderr` at exit: once the relay has read it, it has
# passed on everything written before (a pipe keeps order). Not a line any library prints.
_END = b"\x1eechoic: end of stderr\x1e\n"
_ended = threading.Event()  # the relay has read _END


def _pass_on(read: int, chatter: re.Pattern[str]) -> None:
    """The pipe's lines to fd 2, but chatter, for the life of the process (or until the
    pipe closes)."""
    pending = b""
    while chunk := os.read(read, 65536):
        *lines, pending = (pending + chunk).split(b"\n")
        kept = []
        for line in lines:
            end = line.endswith(_END[:-1])
            if end:  # and before it, a last line with no end of its own, if any
                line = line[: 1 - len(_END)]
                _ended.set()
            if (line or not end) and not chatter.fullmatch(line.decode(errors="replace").strip()):
                kept.append(line if end else line + b"\n")
        if kept:
            os.write(2, b"".join(kept))
    if pending and not chatter.fullmatch(pending.decode(errors="replace").strip()):
        os.write(2, pending)
    os.close(read)


def _drain(libc: ctypes.CDLL, c_stderr: ctypes.c_void_p, previous: int, stream: int) -> None:
    """At exit: C's `stderr` as it was, and what is still in the pipe passed on to fd 2
    before the process ends (the relay says when it reaches _END). The pipe's FILE stays
    open: a native library may still hold it (one that cached `stderr`, a thread mid-write,
    a destructor that runs after this), and glibc aborts the process ("invalid stdio
    handle") on a write to a FILE that was closed."""
    c_stderr.value = previous
    libc.fwrite.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_void_p]
    libc.fwrite(_END, 1, len(_END), stream)
    libc.fflush(stream)
    _ended.wait(timeout=1.0)
