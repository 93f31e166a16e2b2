"""`assistgen generate --prediction FILE`: the file's text is drafted from and the output is the same as without it;
an unreadable file is a clear error before any model loads."""

from __future__ import annotations

import pytest

from assistgen.cli.main import main

pytestmark = pytest.mark.integration

ASK = "Repeat exactly: def area(width, height): return width * height"


def test_the_output_is_the_same_with_the_prediction_and_it_is_drafted_from(tmp_path, capsys):
    base = ["generate", "--model", "smollm2-135m", "--chat", "--max-new-tokens", "24", ASK]
    assert main(base) == 0
    plain = capsys.readouterr()
    predicted = tmp_path / "predicted.txt"
    predicted.write_text(plain.out.strip())
    assert main([*base, "--prediction", str(predicted)]) == 0
    drafted = capsys.readouterr()
    assert drafted.out == plain.out
    assert "mode prediction" in drafted.err and "prediction tokens:" in drafted.err
    assert main([*base, "--prediction", str(tmp_path / "missing.txt")]) == 2
    assert "--prediction" in capsys.readouterr().err
