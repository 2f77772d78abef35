import subprocess
import sys

import pytest

from charstream.pipeline.cli import COMMANDS, build_parser, main
from charstream.pipeline.config import PipelineConfig


def test_help_lists_every_command():
    out = subprocess.run([sys.executable, "-m", "charstream", "--help"], capture_output=True, text=True, check=True)
    for words, _, _ in COMMANDS:
        assert words[0] in out.stdout


def test_every_command_has_a_parser():
    _, leaves = build_parser()
    assert set(leaves) == {words for words, _, _ in COMMANDS}


USAGE_ERRORS = [  # (argv, what argparse says after "argument OPTION: ")
    (["serve", "--port", "99999"], "99999 is not a TCP port (0-65535"),
    (["serve", "--metrics-port", "-1"], "-1 is not a TCP port (0-65535"),
    (["demo", "--port", "65536"], "65536 is not a TCP port (0-65535"),
    (["engine", "--metrics-port", "x"], "not a whole number: 'x'"),
    (["bench", "transport", "--transports", "ipc,nope"], "unknown ['nope']; known: inproc, ipc, tcp"),
    (["bench", "fuzz", "--targets", "tcp,udp"], "unknown ['udp']; known: agent, config, http, ipc, tcp"),
    (["bench", "soak", "--sessions", "-1"], "must be >= 1, got -1"),
    (["bench", "fleet", "--nodes", "2,x"], "not a whole number: 'x'"),
    (["bench", "fleet", "--sessions", "1,0"], "must be >= 1, got 0"),
    (["bench", "asr", "--recognizers", "whisper,klingon"],
     "unknown ['klingon']; known: moonshine, pocketsphinx-domain, pocketsphinx-general, whisper"),
]


@pytest.mark.parametrize("argv, said", USAGE_ERRORS, ids=[" ".join(a) for a, _ in USAGE_ERRORS])
def test_a_bad_option_value_is_a_usage_error_naming_it(argv, said, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert f"argument {argv[-2]}: {said}" in capsys.readouterr().err


def test_a_config_file_value_out_of_range_is_refused_with_its_key(tmp_path, capsys):
    (tmp_path / "bad.toml").write_text("[egress]\nport = 70000\n")
    assert main(["serve", "--config", str(tmp_path / "bad.toml")]) == 2
    assert "charstream serve: egress.port: 70000 is not a TCP port" in capsys.readouterr().out
    assert main(["serve", "--preset", "nope"]) == 2  # an option is checked as its config key is
    assert "charstream serve: unknown model preset 'nope'" in capsys.readouterr().out
    (tmp_path / "flat.toml").write_text("egress = 3\n")  # a section that is not a table, with an option into it
    assert main(["serve", "--config", str(tmp_path / "flat.toml"), "--port", "0"]) == 2
    assert "charstream serve: config egress: expected a table, got int" in capsys.readouterr().out
    assert PipelineConfig.from_dict({"egress": {"port": 0}}).egress.port == 0  # 0 picks a free one


@pytest.mark.parametrize("data, said", [
    ({"tracing": {"prometheus_port": 65536}}, "tracing.prometheus_port: 65536 is not a TCP port"),
    ({"egress": {"max_sessions": 0}}, r"egress.max_sessions: 0 is not a number in \[1, 10000\]"),
    ({"ingest": {"vad_threshold": 5.0}}, r"ingest.vad_threshold: 5.0 is not a speech probability in \(0, 1\)"),
    ({"ingest": {"vad_silence_ms": 0}}, r"ingest.vad_silence_ms: 0 is not a number in \[1, 10000\]"),
    ({"hosting": "weird"}, "hosting must be one of inproc, processes, engine, got 'weird'"),
    ({"preset": "nope"}, "unknown model preset 'nope'"),
], ids=["prometheus_port", "max_sessions", "vad_threshold", "vad_silence_ms", "hosting", "preset"])
def test_a_config_that_would_fail_late_or_silently_is_refused_when_built(data, said):
    with pytest.raises(ValueError, match=said):
        PipelineConfig.from_dict(data)


REFUSALS = [  # (argv, the one line that says why; {bad}: a file that is not JSON)
    (["quality", "--baseline", "nope", "--candidate", "fp8-ring"], "charstream quality: no config file 'nope'"),
    (["quality", "--baseline", "{bad}", "--candidate", "fp8-ring"], "charstream quality: {bad}: not JSON"),
    (["model", "info", "--tp", "7"], "charstream model info: model config 'tiny': n_heads 12 is not divisible"),
    (["bench", "model", "--steps", "0"], "charstream bench model: --steps must be >= 1"),
    (["demo", "--script", "{bad}", "--turns", "1"], "charstream demo: {bad}: not JSON"),
    (["serve", "--adapter", "pipecat"], "charstream serve: ingest adapter 'pipecat': serve's sessions make"),
]


@pytest.mark.parametrize("argv, said", REFUSALS, ids=[" ".join(a[:2]) for a, _ in REFUSALS])
def test_bad_input_to_a_command_is_one_line_naming_it_before_anything_starts(argv, said, tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{oops")
    argv, said = [a.replace("{bad}", str(bad)) for a in argv], said.replace("{bad}", str(bad))
    try:
        status = main(argv)
    except SystemExit as e:  # SystemExit(message): the message on stderr, status 1
        status = e.code
    text = status if isinstance(status, str) else capsys.readouterr().out
    assert status not in (0, None) and text.startswith(said), text


@pytest.mark.parametrize("argv", [["demo", "--placement", "processes"], ["bench", "soak", "--placement", "inproc"],
                                  ["bench", "capacity", "--placement", "engine"]], ids=["demo", "soak", "capacity"])
def test_the_renamed_placement_option_is_refused_naming_hosting(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"charstream {' '.join(argv[:-2])}: --placement is now --hosting"]


def test_the_renamed_placement_config_key_is_refused_naming_hosting(tmp_path, capsys):
    with pytest.raises(ValueError, match="^config key 'placement' is now 'hosting'"):
        PipelineConfig.from_dict({"placement": "processes"})
    (tmp_path / "old.toml").write_text('placement = "processes"\n')
    assert main(["serve", "--config", str(tmp_path / "old.toml")]) == 2
    assert capsys.readouterr().out.strip() == ("charstream serve: config key 'placement' is now 'hosting' "
                                               "(inproc, processes or engine)")


def test_a_bad_log_level_in_the_environment_is_one_usage_error(monkeypatch, capsys):
    monkeypatch.setenv("CHARSTREAM_LOG_LEVEL", "loud")
    with pytest.raises(SystemExit) as exit_:
        main(["trace", "report", "nothing.jsonl"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "CHARSTREAM_LOG_LEVEL: 'loud' is not a log level (one of debug, info, warning, error, critical)" in err
    assert "Traceback" not in err
