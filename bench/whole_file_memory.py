"""Peak memory of one `echoic serve` recognizing a long whole file, over HTTP or gRPC.

    python bench/whole_file_memory.py [--minutes 3 12.6] [--door http grpc] [--model DIR]

For each door and length, a fresh `echoic serve` (greedy, one ONNX thread) gets one
request: a PCM16 16 kHz mono WAV of the fixtures' real clip (and 0.5 s of silence) repeated
to that length (12.6
minutes is 23 MiB, inside the default --max-upload-mb 25). Prints the server's resident
memory (VmRSS) once it serves, its peak (VmHWM, the kernel's high-water mark) over the
request, the growth, the upload's size, and the words recognized (the same on every
door and every run of one length).
"""

from __future__ import annotations

import argparse
import http.client
import io
import json
import socket
import subprocess
import sys
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


def _speech(minutes: float) -> bytes:
    from echoic.model.core.audio import decode_audio

    clip = ROOT / "tests" / "fixtures" / "nemo" / "clip.flac"  # espeak-ng's "the quick brown fox"
    one = np.concatenate([decode_audio(clip.read_bytes(), 16000), np.zeros(8000, np.float32)])
    n = int(minutes * 60 * 16000)
    audio = np.resize(one, n)
    out = io.BytesIO()
    sf.write(out, audio, 16000, format="WAV", subtype="PCM_16")
    return out.getvalue()


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


def measure(door: str, minutes: float, model: str) -> dict:
    wav = _speech(minutes)
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
    return dict(door=door, minutes=minutes, upload_mib=len(wav) / 2**20, rss_mb=before / 1024,
                peak_mb=peak / 1024, growth_mb=(peak - before) / 1024, after_mb=after / 1024,
                seconds=seconds, words=words)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, nargs="+", default=[3.0, 12.6])
    parser.add_argument("--door", nargs="+", choices=("http", "grpc"), default=["http", "grpc"])
    parser.add_argument("--model", default=str(ROOT / "model" / "default"))
    args = parser.parse_args()
    print(
        "| door | audio, min | upload, MiB | RSS serving, MB | peak, MB | growth, MB "
        "| RSS after, MB | request, s | words |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for minutes in args.minutes:
        for door in args.door:
            r = measure(door, minutes, args.model)
            print(f"| {r['door']} | {r['minutes']:g} | {r['upload_mib']:.1f} | {r['rss_mb']:.0f} "
                  f"| {r['peak_mb']:.0f} | {r['growth_mb']:.0f} | {r['after_mb']:.0f} "
                  f"| {r['seconds']:.1f} | {r['words']} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
