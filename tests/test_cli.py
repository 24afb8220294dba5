"""Every subcommand answers --help; `dspark generate --json` runs end to end on the embedded model."""
import json
import subprocess
import sys

import pytest

from dspark.cli import build_parser


def _all_commands(parser, prefix=()):
    for action in parser._actions:
        if hasattr(action, "choices") and isinstance(action.choices, dict):
            for name, sub in action.choices.items():
                yield (*prefix, name)
                yield from _all_commands(sub, (*prefix, name))


@pytest.mark.parametrize("command", list(_all_commands(build_parser())), ids=" ".join)
def test_help(command, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([*command, "--help"])
    assert exc.value.code == 0
    assert "usage: dspark" in capsys.readouterr().out


def test_generate_json_end_to_end():
    out = subprocess.run([sys.executable, "-m", "dspark.cli", "generate", "--prompt", "What is 2+2?",
                          "--max-new-tokens", "12", "--json", "--drafter", "ngram", "--logprobs", "2"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert 0 < result["new_tokens"] <= 12 and result["text"]
    assert result["tau"] >= 1.0 and result["ttft_s"] > 0
    assert result["drafter_used"] == "ngram" and result["policy"] == "fixed-7"  # n-gram has no confidence head
    entries = result["logprobs"]  # greedy: each chosen token is its position's most likely
    assert len(entries) == result["new_tokens"] and all(len(e["top"]) == 2 for e in entries)
    assert all(abs(e["logprob"] - e["top"][0]["logprob"]) < 1e-5 <= -e["top"][1]["logprob"] for e in entries)


@pytest.mark.parametrize("extra,message", [(["--logprobs", "2"], "--logprobs needs --json"),
                                           (["--json", "--logprobs", "30"], "logprobs must be")])
def test_generate_refuses_bad_logprobs_before_loading(extra, message):
    out = subprocess.run([sys.executable, "-m", "dspark.cli", "generate", "--prompt", "x", *extra],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and message in out.stderr and "Traceback" not in out.stderr
