"""The ``kvcanary`` command line itself (issue 10 item 6): --version, arguments checked before the run,
kvcanary's errors caught by type, the demo's JSON records versions, device and seed."""
from __future__ import annotations

import json

import pytest
import torch

import kvcanary
from kvcanary.cli import main as cli_main
from kvcanary.errors import KvCanaryIndexError


def _no_demo(**kwargs):
    raise AssertionError("the demo ran although its arguments were bad")


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli_main.main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvcanary {kvcanary.__version__}"


def test_json_path_is_checked_before_the_run(tmp_path, capsys):
    pytest.importorskip("transformers")
    rc = cli_main.main(["demo", "--json", str(tmp_path / "missing" / "out.json")], demo_runner=_no_demo)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert err[0].startswith("kv-canary: --json ") and "does not exist" in err[0]
    rc = cli_main.main(["demo", "--json", str(tmp_path)], demo_runner=_no_demo)
    assert rc == 2 and "is a directory" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_cuda_without_a_gpu_is_a_one_line_error(capsys):
    pytest.importorskip("transformers")
    rc = cli_main.main(["demo", "--device", "cuda"], demo_runner=_no_demo)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("kv-canary: device 'cuda' is not usable")


def test_kvcanary_errors_are_caught_by_type(capsys):
    pytest.importorskip("transformers")

    def broken(**kwargs):
        raise KvCanaryIndexError("kv-canary: request row 9 is outside the request table")

    assert cli_main.main(["demo"], demo_runner=broken) == 2
    assert capsys.readouterr().err.strip() == "kv-canary: request row 9 is outside the request table"


def test_demo_json_records_versions_device_and_seed(tmp_path):
    pytest.importorskip("transformers")
    import transformers

    out = tmp_path / "demo.json"
    rc = cli_main.main(["demo", "--models", "", "--seed", "7", "--device", "cpu", "--json", str(out)])
    result = json.loads(out.read_text())
    assert rc == 0
    assert result["seed"] == 7 and result["device"] == "cpu"
    assert result["versions"]["kvcanary"] == kvcanary.__version__
    assert result["versions"]["torch"] == torch.__version__
    assert result["versions"]["transformers"] == transformers.__version__
    assert result["versions"]["python"].count(".") == 2


def test_unknown_demo_model_lists_the_valid_ones_before_the_run(capsys):
    pytest.importorskip("transformers")
    assert cli_main.main(["demo", "--models", "gpt2"], demo_runner=_no_demo) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kv-canary: unknown demo model 'gpt2' (--models: ")
    assert "llama" in err[0] and "qwen3_swa" in err[0]


def test_demo_json_says_where_it_wrote(tmp_path, capsys):
    pytest.importorskip("transformers")
    out = tmp_path / "demo.json"
    assert cli_main.main(["demo", "--models", "", "--device", "cpu", "--json", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out and out.is_file()


def _options(parser):
    """(subcommand, option strings, help) for every option of every subcommand."""
    import argparse

    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, p in sub.choices.items():
        for action in p._actions:
            if action.option_strings and not isinstance(action, argparse._HelpAction):
                yield name, action.option_strings, action.help


def test_every_option_of_every_command_has_help_text():
    missing = [(name, opts) for name, opts, text in _options(cli_main._parser()) if not text]
    assert not missing, missing
    names = {name for name, _, _ in _options(cli_main._parser())}
    assert {"demo", "pd", "campaign", "replay", "report"} <= names
