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
                          "--max-new-tokens", "12", "--json", "--drafter", "ngram"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert 0 < result["new_tokens"] <= 12 and result["text"]
    assert result["tau"] >= 1.0 and result["ttft_s"] > 0
    assert result["drafter_used"] == "ngram" and result["policy"] == "fixed-7"  # n-gram has no confidence head
