"""Peak memory of one `echoic serve` recognizing a long whole file, over HTTP or gRPC.

    python bench/whole_file_memory.py [--case pcm16:12.6 mulaw:52 opus:59.8]
        [--door http grpc] [--model DIR]

For each case (a kind of file and its length, minutes) and door, a fresh `echoic serve`
(greedy, one ONNX thread) gets one request: the fixtures' real clip (and 0.5 s of silence)
repeated to that length, as
- pcm16: a PCM16 16 kHz mono WAV (12.6 minutes is 23 MiB, inside the default
  --max-upload-mb 25);
- mulaw: a G.711 mu-law 8 kHz WAV (52 minutes is 24 MiB);
- opus: an Ogg/Opus at 48 kHz and Opus's lowest bitrate (59.8 minutes, 3,590 s, inside the
  default --max-audio-seconds 3600, is some 2.5 MB; 690 MB as float32 at 48 kHz).
Prints the server's resident memory (VmRSS) once it serves, its peak (VmHWM, the kernel's
high-water mark) over the request, the growth, the upload's size, and the words
recognized (the same on every door and every run of one case). The server's process is
the one that receives and decodes the file (with the default engine process, the model
runs in a child of it). Encoded files are kept in the temporary directory between runs.
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import soundfile as sf

ROOT = Path(__file__).resolve().parents[1]


def _status_kb(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# kind: (libsndfile format, subtype, sample rate in Hz, extra arguments)
KINDS = {
    "pcm16": ("WAV", "PCM_16", 16000, {}),
    "mulaw": ("WAV", "ULAW", 8000, {}),
    "opus": ("OGG", "OPUS", 48000, {"compression_level": 1.0}),
}


def _speech(kind: str, minutes: float) -> bytes:
    """The clip and its pause repeated to `minutes`, encoded as `kind`, written a clip at
    a time (a 60-minute 48 kHz file is never whole in memory here either)."""
    from echoic.model.core.audio import MonoResampler, decode_audio

    fmt, subtype, rate, extra = KINDS[kind]
    kept = Path(tempfile.gettempdir()) / f"echoic-bench-{kind}-{minutes:g}min.{fmt.lower()}"
    if kept.exists():
        return kept.read_bytes()
    clip = ROOT / "tests" / "fixtures" / "nemo" / "clip.flac"  # espeak-ng's "the quick brown fox"
    one = np.concatenate([decode_audio(clip.read_bytes(), 16000), np.zeros(8000, np.float32)])
    to_rate = MonoResampler(16000, rate)
    one = np.concatenate([to_rate(one[:, None]), to_rate(one[:0, None], last=True)])
    left = int(minutes * 60 * rate)
    part = kept.with_suffix(".part")
    with sf.SoundFile(part, "w", rate, 1, subtype, format=fmt, **extra) as f:
        while left > 0:
            f.write(one[:left])
            left -= len(one)
    part.rename(kept)
    return kept.read_bytes()


def _request(door: str, http_port: int, grpc_port: int, wav: bytes) -> int:
    """One request; the words recognized."""
    if door == "http":
        boundary = "b0undary"
        body = (f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"'
                f"\r\n\r\n").encode() + wav + (
            f'\r\n--{boundary}\r\nContent-Disposition: form-data; name="formatting"\r\n\r\n'
            f"false\r\n--{boundary}--\r\n").encode()  # fmt: skip
        conn = http.client.HTTPConnection("127.0.0.1", http_port, timeout=600)
        conn.request("POST", "/v1/audio/transcriptions", body,
                     {"Content-Type": f"multipart/form-data; boundary={boundary}"})  # fmt: skip
        response = conn.getresponse()
        text = json.loads(response.read())
        assert response.status == 200, text
        return len(text["text"].split())
    import grpc

    from echoic.protos.v1 import transcriber_pb2 as pb
    from echoic.protos.v1 import transcriber_pb2_grpc as pb_grpc

    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}", options=[
        ("grpc.max_send_message_length", 64 << 20)]) as channel:  # fmt: skip
        r = pb_grpc.TranscriberStub(channel).Recognize(
            pb.RecognizeRequest(config=pb.RecognitionConfig(), audio_content=wav), timeout=600
        )
    return sum(len(x.alternatives[0].transcript.split()) for x in r.results)


def measure(door: str, kind: str, minutes: float, model: str) -> dict:
    wav = _speech(kind, minutes)
    http_port, grpc_port = _free_port(), _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "echoic.cli.main", "serve", "--model", model, "--port",
         str(grpc_port), "--http-port", str(http_port), "--threads", "1", "--decoder",
         "greedy"], stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        for line in server.stderr:
            if "listening on" in line:
                break
        time.sleep(1.0)
        before = _status_kb(server.pid, "VmRSS")
        # the high-water mark so far is the start's (loading); reset it to now
        Path(f"/proc/{server.pid}/clear_refs").write_text("5")
        started = time.perf_counter()
        words = _request(door, http_port, grpc_port, wav)
        seconds = time.perf_counter() - started
        peak = _status_kb(server.pid, "VmHWM")
        after = _status_kb(server.pid, "VmRSS")
    finally:
        server.terminate()
        server.communicate(timeout=60)
    return dict(door=door, kind=kind, minutes=minutes, upload_mib=len(wav) / 2**20,
                rss_mb=before / 1024, peak_mb=peak / 1024, growth_mb=(peak - before) / 1024,
                after_mb=after / 1024, seconds=seconds, words=words)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", nargs="+", default=["pcm16:12.6", "mulaw:52", "opus:59.8"],
                        help="KIND:MINUTES, KIND one of " + ", ".join(KINDS))  # fmt: skip
    parser.add_argument("--door", nargs="+", choices=("http", "grpc"), default=["http", "grpc"])
    parser.add_argument("--model", default=str(ROOT / "model" / "default"))
    args = parser.parse_args()
    cases = [(kind, float(minutes)) for kind, minutes in (c.split(":") for c in args.case)]
    for kind, _ in cases:
        if kind not in KINDS:
            parser.error(f"unknown kind {kind!r} in --case (known: {', '.join(KINDS)})")
    print(
        "| door | file | audio, min | upload, MiB | RSS serving, MB | peak, MB | growth, MB "
        "| RSS after, MB | request, s | words |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for kind, minutes in cases:
        for door in args.door:
            r = measure(door, kind, minutes, args.model)
            print(f"| {r['door']} | {kind} | {r['minutes']:g} | {r['upload_mib']:.1f} "
                  f"| {r['rss_mb']:.0f} "
                  f"| {r['peak_mb']:.0f} | {r['growth_mb']:.0f} | {r['after_mb']:.0f} "
                  f"| {r['seconds']:.1f} | {r['words']} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
