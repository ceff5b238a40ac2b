"""`echoic serve`'s flags come from ServerConfig: names, types, defaults and help in one place.

No server runs here: the flags are parsed and turned into a ServerConfig.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from echoic.cli.main import build_parser, main
from echoic.cli.serve import from_flags
from echoic.server.config import CPU, CUDA_THEN_CPU, ServerConfig

# The flags README.md, the Dockerfile, bench/ and the tests use: each must stay.
FLAGS = {
    "--model", "--model-repo", "--default-model", "--poll-seconds", "--host", "--port",
    "--metrics-port", "--http-port",
    "--metrics-host", "--max-batch", "--max-wait-ms", "--threads", "--no-ort-spin", "--device",
    "--beam-processes", "--decoder", "--engine", "--batch-lanes",
    "--gpu", "--max-streams", "--workers",
    "--chunk-ms", "--chunk-left-ms", "--chunk-right-ms",
    "--max-audio-seconds", "--idle-timeout-seconds", "--max-stream-seconds", "--max-beam-size",
    "--punctuation-model",
    "--max-message-bytes", "--max-http-connections", "--max-upload-mb", "--upload-timeout-seconds",
    "--min-upload-bytes-per-second", "--decode-threads",
    "--decode-timeout-seconds",
    "--max-connection-age", "--grace-seconds", "--no-reflection", "--expose-paths",
    "--tls-cert", "--tls-key", "--tls-client-ca", "--log-level", "-h", "--help",
}  # fmt: skip


def _serve_parser() -> argparse.ArgumentParser:
    (commands,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return commands.choices["serve"]


def _config(*flags: str) -> ServerConfig:
    return from_flags(ServerConfig, _serve_parser().parse_args(list(flags)))


def test_every_field_is_a_flag_or_deliberately_not_one() -> None:
    dests = {a.dest for a in _serve_parser()._actions}
    for field in dataclasses.fields(ServerConfig):
        assert field.metadata.get("help"), f"{field.name}: not a setting(), or no help"
        assert "flag" in field.metadata, f"{field.name}: neither a Flag nor flag=None"
        assert (field.metadata["flag"] is not None) == (field.name in dests), field.name


def test_flag_names_stay() -> None:
    assert {s for a in _serve_parser()._actions for s in a.option_strings} == FLAGS


def test_the_default_command_line_is_the_default_config() -> None:
    assert _config() == ServerConfig()


@pytest.mark.parametrize(
    ("flags", "field", "value"),
    [
        pytest.param(["--threads", "2"], "intra_op_threads", 2, id="renamed-int"),
        pytest.param(["--max-wait-ms", "5"], "max_wait_ms", 5.0, id="float"),
        pytest.param(["--metrics-port", "9090"], "metrics_port", 9090, id="optional-int"),
        pytest.param(["--host", "0.0.0.0"], "host", "0.0.0.0", id="str"),
        pytest.param(["--model", "models/m/3"], "model_dir", Path("models/m/3"), id="path"),
        pytest.param(["--no-ort-spin"], "ort_spin_wait", False, id="switch"),
        pytest.param(["--device", "cuda"], "device", "cuda", id="device"),
        pytest.param(["--gpu"], "device", "cuda", id="alias"),
        pytest.param(["--decoder", "greedy"], "decoder", "greedy", id="decoder"),
        pytest.param(["--engine", "process"], "engine", "process", id="engine"),
    ],
)  # fmt: skip
def test_flags_round_trip_with_their_types(flags: list[str], field: str, value: Any) -> None:
    got = getattr(_config(*flags), field)
    assert got == value and type(got) is type(value)


def test_help_shows_the_config_defaults() -> None:
    text = " ".join(_serve_parser().format_help().split())
    for shown in ("(default 50051)", "(default 5)", "(default 33554432)", "unset = off",
                  "{auto,greedy,beam}", "(default auto)"):  # fmt: skip
        assert shown in text
    assert "(default None)" not in text


def test_device_picks_the_providers() -> None:
    assert _config().providers == CPU
    assert _config("--device", "cuda").providers == _config("--gpu").providers == CUDA_THEN_CPU


def test_an_unknown_device_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--device", "tpu"]) == 1
    assert capsys.readouterr().err == "echoic serve: error: device must be one of cpu, cuda\n"


def test_an_unknown_decoder_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--decoder", "viterbi"]) == 1
    assert capsys.readouterr().err == (
        "echoic serve: error: decoder must be one of auto, greedy, beam, got 'viterbi'\n"
    )


def test_model_and_model_repo_exclude_each_other() -> None:
    with pytest.raises(SystemExit):
        _serve_parser().parse_args(["--model", "a", "--model-repo", "b"])


def test_a_bad_combination_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--tls-key", "server.key"]) == 1
    assert capsys.readouterr().err == "echoic serve: error: TLS needs both cert and key\n"


def test_echoic_version(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"echoic {version('echoic')}\n"
