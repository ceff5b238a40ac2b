"""A batch job of thousands of files, in this process and through a busy server.

    python bench/batch_job.py [--files 3000] [--model DIR] [--max-streams 4]
                              [--concurrency 16] [--manifest FILE] [--workdir DIR]

Makes (`echoic synth`, two voices for each of 24 sentences) or reuses (--manifest) a
few dozen distinct utterances and fans them out into --files inputs across nested
folders (`in/part0/spk07/utt00350.wav`, hard links where the file system allows, else
copies), a handful of them broken on purpose: empty, garbage, a FLAC cut short and a
WAV whose data stops before its header says. Then runs the same job twice, each
`echoic transcribe` in its own process:

  local    echoic transcribe in/ --output local.jsonl (the model in that process)
  server   echoic transcribe in/ --server ... --concurrency 16 --output server.jsonl,
           against `echoic serve --max-streams 4` started here in a process of its
           own on a loopback port (so most calls at first are refused as busy,
           retried, and the client settles to what the server admits)

and prints, for each: files, hours of audio, wall time (the job process from start
to exit: model loading included for the local job; the server was up before),
audio seconds per second, failed files, retries, and whether its transcripts equal
the other run's, file by file. Below the table it checks what a job must hold: every
input has exactly one row, every good file a transcript, every broken one reported
(an error row, or for the short WAV a warning in the summary).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from serve_load import start_server, stop_server  # this folder: python bench/batch_job.py

from echoic.clients import Client, ClientError, RetryPolicy

ECHOIC = [sys.executable, "-m", "echoic.cli.main"]
SENTENCES = """\
The quick brown fox jumps over the lazy dog.
She sells sea shells by the sea shore.
A journey of a thousand miles begins with a single step.
All that glitters is not gold.
Time flies like an arrow and fruit flies like a banana.
Where there is smoke there is fire.
The early bird catches the worm.
Actions speak louder than words.
Every cloud has a silver lining.
Fortune favours the bold and the brave.
Good things come to those who wait.
Honesty is the best policy in the long run.
Knowledge is power and power is knowledge.
Make hay while the sun shines over the fields.
No man is an island entire of itself.
Out of sight is out of mind.
Rome was not built in a day.
The pen is mightier than the sword.
Two heads are better than one when the work is hard.
You cannot judge a book by its cover.
A picture is worth a thousand words.
Beauty is in the eye of the beholder.
Do not count your chickens before they hatch.
Easy come, easy go, as the old saying goes.
"""
# The broken inputs, by name, and whether the job must fail them (an error row) or
# transcribe them with a warning (a WAV whose data ends early: what is there is audio).
BROKEN = {"empty.wav": True, "garbage.flac": True, "cut.flac": True, "short.wav": False}


def synthesize(workdir: Path) -> Path:
    text = workdir / "sentences.txt"
    text.write_text(SENTENCES)
    out = workdir / "corpus"
    subprocess.run(
        [*ECHOIC, "synth", "--text", str(text), "--out", str(out), "--voices-per-sentence",
         "2", "--jobs", str(os.cpu_count() or 1)],
        check=True, capture_output=True, timeout=1800,
    )  # fmt: skip
    return out / "manifest.jsonl"


def utterance_files(manifest: Path) -> list[Path]:
    files = []
    for line in manifest.read_text().splitlines():
        path = Path(json.loads(line)["audio_filepath"])
        files.append(path if path.is_absolute() else manifest.parent / path)
    return files


def place(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, target)
    except OSError:  # another file system, or one without hard links
        shutil.copyfile(source, target)


def fan_out(utterances: list[Path], root: Path, count: int) -> dict[str, bool]:
    """`count` inputs under `root` (part/speaker/utterance folders), the broken ones
    spread among them; returns {path: must fail} for the broken ones."""
    import soundfile as sf

    good = count - len(BROKEN)
    if good < 1:
        raise SystemExit(f"--files must be more than {len(BROKEN)} (the broken inputs)")
    slots = {round((n + 1) * count / (len(BROKEN) + 1)): name for n, name in enumerate(BROKEN)}
    broken: dict[str, bool] = {}
    used = 0
    for i in range(count):
        folder = root / f"part{i // 1000}" / f"spk{(i // 50) % 20:02d}"
        if i in slots:
            name = slots[i]
            path = folder / f"utt{i:05d}_{name}"
            folder.mkdir(parents=True, exist_ok=True)
            source = utterances[i % len(utterances)]
            if name == "empty.wav":
                path.write_bytes(b"")
            elif name == "garbage.flac":
                path.write_bytes(os.urandom(6000))
            elif name == "cut.flac":
                audio, rate = sf.read(source)
                sf.write(path, audio, rate, format="FLAC")
                path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])
            else:  # the data stops at a third of what the header says
                data = source.read_bytes()
                path.write_bytes(data[: 44 + (len(data) - 44) // 3 // 2 * 2])
            broken[str(path)] = BROKEN[name]
        else:
            place(utterances[used % len(utterances)], folder / f"utt{i:05d}.wav")
            used += 1
    return broken


def wait_until_serving(server, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    with Client(server.target, retry=RetryPolicy(attempts=1), timeout=10) as client:
        while True:
            if server.process.poll() is not None:
                raise SystemExit(f"the server exited with status {server.process.returncode}")
            try:
                client.list_models()
                return
            except ClientError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)


@dataclass
class Run:
    name: str
    wall: float  # s, the job process from start to exit
    summary: dict  # its --json summary
    rows: dict[str, dict]  # audio_filepath -> its output row
    row_count: int  # lines in the output (one per input when nothing is lost or doubled)
    stderr: str


def transcribe(name: str, inputs: Path, out: Path, extra: list[str]) -> Run:
    cmd = [*ECHOIC, "transcribe", str(inputs), "--output", str(out), "--no-progress",
           "--json", *extra]  # fmt: skip
    print(f"{name}: {' '.join(cmd[2:])}", file=sys.stderr, flush=True)
    start = time.perf_counter()
    job = subprocess.run(cmd, capture_output=True, text=True, timeout=7200)
    wall = time.perf_counter() - start
    if job.returncode not in (0, 1):  # 1: the broken inputs failed, as they must
        raise SystemExit(f"{name}: exit {job.returncode}\n{job.stderr[-3000:]}")
    lines = out.read_text().splitlines()
    rows = {row["audio_filepath"]: row for row in map(json.loads, lines)}
    return Run(name, wall, json.loads(job.stdout), rows, len(lines), job.stderr)


def check(run: Run, inputs: list[str], broken: dict[str, bool]) -> list[str]:
    """What the job must hold; the problems found (none when it held)."""
    problems = []
    missing = [p for p in inputs if p not in run.rows]
    if missing or run.row_count != len(inputs):
        problems.append(f"{len(missing)} inputs without a row, {run.row_count} rows for"
                        f" {len(inputs)} inputs (e.g. {missing[:2]})")  # fmt: skip
    failed_good = [p for p in inputs if p not in broken and "error" in run.rows.get(p, {})]
    if failed_good:
        problems.append(f"{len(failed_good)} good files failed, e.g. {failed_good[0]}:"
                        f" {run.rows[failed_good[0]]['error']}")  # fmt: skip
    warned = " ".join(run.summary["warnings"])
    for path, must_fail in broken.items():
        reported = "error" in run.rows.get(path, {}) if must_fail else path in warned
        if not reported:
            problems.append(f"{path} was not reported")
    return problems


def agreement(run: Run, other: Run) -> str:
    same = sum(
        1 for path, row in run.rows.items()
        if path in other.rows and row.get("text", "\0error") == other.rows[path].get("text",
                                                                                     "\0error")
    )  # fmt: skip
    return f"{same}/{len(run.rows)}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--files", type=int, default=3000, help="inputs, the broken ones included")
    p.add_argument("--model", help="exported model directory (default: the bundled model)")
    p.add_argument("--max-streams", type=int, default=4, help="the server's --max-streams")
    p.add_argument("--concurrency", type=int, default=16, help="the server job's --concurrency")
    p.add_argument("--manifest", help="utterances to fan out (default: synthesize 48)")
    p.add_argument("--workdir", help="keep the corpus, inputs (in/) and outputs here, an earlier"
                   " run's replaced (default: a temporary folder, removed)")  # fmt: skip
    args = p.parse_args()
    from echoic.model.runtime.recognizer import default_model_dir

    model = str(Path(args.model or default_model_dir()).resolve())
    temporary = None if args.workdir else tempfile.TemporaryDirectory(prefix="batch-job-")
    workdir = Path(args.workdir or temporary.name)
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        manifest = Path(args.manifest) if args.manifest else synthesize(workdir)
        utterances = utterance_files(manifest)
        inputs_dir = workdir / "in"
        if inputs_dir.exists():  # an earlier run's, replaced
            shutil.rmtree(inputs_dir)
        for job in ("local", "server"):
            for suffix in ("", ".job", ".torn"):
                (workdir / f"{job}.jsonl{suffix}").unlink(missing_ok=True)
        broken = fan_out(utterances, inputs_dir, args.files)
        inputs = sorted(str(f) for f in inputs_dir.rglob("*") if f.is_file())
        print(f"{len(inputs)} inputs from {len(utterances)} utterances, {len(broken)} broken,"
              f" in {inputs_dir}", file=sys.stderr)  # fmt: skip

        local = transcribe("local", inputs_dir, workdir / "local.jsonl", ["--model", model])
        with open(workdir / "server.log", "w") as log:
            server = start_server(model, 32, 0.0, args.max_streams, 0, log)
            try:
                wait_until_serving(server)
                remote = transcribe(
                    "server", inputs_dir, workdir / "server.jsonl",
                    ["--server", server.target, "--concurrency", str(args.concurrency)],
                )  # fmt: skip
            finally:
                stop_server(server)
    finally:
        if temporary is not None:
            temporary.cleanup()

    print(f"\n{len(inputs)} files ({len(broken)} broken on purpose) from {len(utterances)}"
          f" distinct utterances; the server at --max-streams {args.max_streams}, the job at"
          f" --concurrency {args.concurrency}\n")  # fmt: skip
    print("| job | files | audio | wall | audio s per s | failed | retries |"
          " transcripts equal the other job's |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for run, other in ((local, remote), (remote, local)):
        s = run.summary
        print(f"| {run.name} | {s['inputs']} | {s['audio_seconds'] / 3600:.2f} h |"
              f" {run.wall:.1f} s | {s['audio_seconds'] / run.wall:.0f} | {s['failed']} |"
              f" {s['retries']} | {agreement(run, other)} |")  # fmt: skip
    for run in (local, remote):  # the job's own closing note
        note = next(line for line in run.stderr.splitlines() if line.startswith("transcribed "))
        print(f"{run.name}: {note}")
    must_fail = sum(broken.values())
    print(f"\nfailed = the broken inputs that cannot be decoded ({must_fail} of them); the"
          f" WAV cut short is transcribed with a warning")  # fmt: skip
    problems = {run.name: check(run, inputs, broken) for run in (local, remote)}
    for name, found in problems.items():
        print(f"{name}: " + ("every input has one row, no good file failed, every broken one"
                             " reported" if not found else "; ".join(found)))  # fmt: skip
    if any(problems.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
