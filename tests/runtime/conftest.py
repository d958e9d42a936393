"""Fixtures shared by the runtime tests."""

from __future__ import annotations

import os

import pytest

from ._entry import text_files


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> str:
    """Real text (the machine's licence files and the README) tokenised by `hpctrain data prepare`'s code."""
    from hpctrain.data.prepare import prepare

    files = text_files()
    if sum(os.path.getsize(f) for f in files) < 100_000:
        pytest.skip("fewer than 100 kB of text files on this machine")
    out = str(tmp_path_factory.mktemp("text") / "tokens.bin")
    prepare(files, out)
    return out
