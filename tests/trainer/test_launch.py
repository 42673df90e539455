"""The test harness's log reader: a record split by another writer fails loudly."""

from __future__ import annotations

import json

import pytest

from tests.trainer.launch import json_lines

STEP = json.dumps({"event": "step", "kind": "progress", "rank": 0, "step": 31})


def test_whole_lines_are_read_and_other_text_is_skipped():
    text = f"epoch 1 done\n{STEP}\nINFO torchrun says {{'rank': 0}}\n"
    assert [r["step"] for r in json_lines(text)] == [31]


def test_a_record_behind_another_writers_text_is_an_error_not_a_lost_step():
    # What a peer's print() did: its text, then the record, then its newline.
    with pytest.raises(AssertionError, match="interleaved"):
        json_lines(f"epoch 1 done{STEP}\n\n")
