"""`echoic stream`: send a file to a server as a live stream and show results as they come."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from typing import Any, TextIO

EXAMPLES = """\
examples:
  echoic stream talk.wav                                  # at real time, to 127.0.0.1:50051
  echoic stream talk.flac --server asr.internal:50051 --fast --chunk-ms 200
  echoic stream talk.wav --json > responses.jsonl         # every response, as JSON lines
  echoic stream call.ogg --model ds2-en/3 --decoder beam --endpoint-silence-ms 600
  echoic stream talk.wav --server asr:443 --tls-ca ca.pem --tls-cert me.pem --tls-key me.key

The file is decoded here (WAV, FLAC, OGG, ... any rate, any channels) and sent as
raw PCM16 chunks; --encoding wav|flac sends the file's bytes as they are instead.
On a terminal, interim results rewrite one line and final results stay, with
their times; otherwise only final results are printed.
"""

DEFAULT_SERVER = "127.0.0.1:50051"


def add_tls_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tls-ca", metavar="PEM", help="CA that signed the server's certificate")
    p.add_argument("--tls-cert", metavar="PEM", help="client certificate (mutual TLS)")
    p.add_argument("--tls-key", metavar="PEM", help="client key (mutual TLS)")
    p.add_argument("--tls-server-name", metavar="NAME", help="expect this name in the"
                   " server's certificate (when it differs from HOST)")  # fmt: skip


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "stream",
        help="stream a file to a server and show live results",
        description="Stream an audio file to an echoic server like a live microphone.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("file", metavar="FILE", help="audio file (WAV, FLAC, OGG, ...)")
    p.add_argument("--server", metavar="HOST:PORT", default=DEFAULT_SERVER,
                   help=f"server address (default: {DEFAULT_SERVER})")  # fmt: skip
    p.add_argument("--fast", action="store_true", help="send as fast as possible, not at real time")
    p.add_argument("--chunk-ms", type=float, default=100.0, help="audio per message, ms")
    p.add_argument("--encoding", choices=("linear16", "wav", "flac"), default="linear16",
                   help="linear16: decode here, send PCM16 (default); wav/flac: send the"
                   " file's bytes as they are")  # fmt: skip
    p.add_argument("--model", metavar="NAME[/VERSION]", default="",
                   help="served model (default: the only one; newest version)")  # fmt: skip
    p.add_argument("--decoder", choices=("greedy", "beam"),
                   help="CTC decoding (default: the server's, echoic serve --decoder)")  # fmt: skip
    p.add_argument("--beam-size", type=int, default=0, help="beam width (0: server's default)")
    p.add_argument("--no-lm", action="store_true", help="beam search without the model's LM")
    p.add_argument("--no-interim", action="store_true", help="final results only")
    p.add_argument("--interim-interval-ms", type=int, default=0,
                   help="least audio between interim results, ms (0: every step)")  # fmt: skip
    p.add_argument("--endpoint-silence-ms", type=int, default=0,
                   help="end an utterance after this much silence, ms (0: off)")  # fmt: skip
    p.add_argument("--max-utterance-ms", type=int, default=0,
                   help="end an utterance after this long, ms (0: off)")  # fmt: skip
    p.add_argument("--words", action="store_true", help="print word times and confidences")
    p.add_argument("--json", action="store_true", help="print each response as a JSON line")
    p.add_argument("--connect-timeout", type=float, default=10.0,
                   help="seconds to wait for the server to be reachable")  # fmt: skip
    add_tls_options(p)
    p.set_defaults(func=run)


class Display:
    """Final results as lines; interim ones rewrite the current line on a terminal."""

    def __init__(self, out: TextIO, live: bool, words: bool) -> None:
        self.out, self.live, self.words = out, live, words
        self._dirty = False

    def _clear(self) -> None:
        if self._dirty:
            self.out.write("\r\x1b[K")
            self._dirty = False

    def interim(self, text: str) -> None:
        if not self.live:
            return
        width = shutil.get_terminal_size().columns - 1
        line = f"... {text}"
        if len(line) > width:  # a wrapped line cannot be rewritten: keep its tail
            line = "..." + line[len(line) - width + 3 :]
        self._clear()
        self.out.write(line)
        self.out.flush()
        self._dirty = True

    def final(self, result: Any) -> None:
        self._clear()
        alt = result.alternatives[0] if result.alternatives else None
        text = alt.transcript if alt else ""
        start, end = result.utterance_start_time, result.utterance_end_time
        self.out.write(f"[{start:.2f}-{end:.2f} s] {text}\n")
        if self.words and alt is not None:
            for w in alt.words:
                self.out.write(
                    f"    {w.start_time:7.2f} {w.end_time:7.2f}  {w.confidence:.2f}  {w.word}\n"
                )
        self.out.flush()

    def close(self) -> None:
        self._clear()
        self.out.flush()


def run(args: argparse.Namespace) -> int:
    from google.protobuf import json_format

    from echoic.cli.errors import UserError
    from echoic.clients import AudioFileError, Client, ClientError

    if args.chunk_ms <= 0:
        raise UserError(f"--chunk-ms must be positive, got {args.chunk_ms:g}")
    name, _, version = args.model.partition("/")
    live = sys.stdout.isatty() and not args.json
    display = Display(sys.stdout, live, args.words)
    model = ""
    try:
        client = Client(
            args.server, tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key,
            tls_server_name=args.tls_server_name, connect_timeout=args.connect_timeout,
        )  # fmt: skip
        with (
            client,
            client.stream_file(
                args.file,
                realtime=not args.fast,
                chunk_ms=args.chunk_ms,
                encoding=args.encoding,
                interim_results=(live or args.json) and not args.no_interim,
                interim_interval_ms=args.interim_interval_ms,
                model=name,
                model_version=version,
                words=args.words or args.json,
                # --beam-size and --no-lm are beam search's: they ask for it
                decoder=args.decoder or ("beam" if args.beam_size or args.no_lm else None),
                beam_size=args.beam_size,
                disable_lm=args.no_lm,
                trailing_silence_ms=args.endpoint_silence_ms,
                max_utterance_ms=args.max_utterance_ms,
            ) as responses,
        ):
            for response in responses:
                model = f"{response.model.name}/{response.model.version}"
                if args.json:
                    row = json_format.MessageToDict(
                        response,
                        preserving_proto_field_name=True,
                        always_print_fields_with_no_presence=True,
                    )
                    print(json.dumps(row), flush=True)
                    continue
                for result in response.results:
                    if result.is_final:
                        display.final(result)
                    elif result.alternatives:
                        display.interim(result.alternatives[0].transcript)
    except (ClientError, AudioFileError, ValueError) as e:
        raise UserError(str(e)) from e
    finally:
        display.close()
    if model and not args.json:
        print(f"model {model}", file=sys.stderr)
    return 0
