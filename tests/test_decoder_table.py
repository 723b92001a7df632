"""The decoder table (kstep/decoding/table.py): every family's key has rows ending in an `otherwise`
row, every row serves some request, and the decoder each printed cell names is the one a real
checkpoint of that family builds for those settings (the table is the code's, not a description)."""
import pytest

import kstep
from kstep.decoding.table import SETTINGS, TABLE, _cell, choose
from kstep.random_checkpoint import write_random_checkpoint
from kstep.registry import FAMILIES


def test_each_family_key_has_rows_that_end_in_otherwise():
    for family in FAMILIES.values():
        rows = [row for row in TABLE if row.key == family.decoder]
        assert rows and rows[-1].when == (), family.name
        assert all(row.when for row in rows[:-1]), family.name  # no row after an otherwise


def test_every_row_serves_some_request():
    reached = {_cell(family, knobs) for family in FAMILIES.values() for _, knobs in SETTINGS}
    for row in TABLE:
        assert any(cell.startswith(f"`{row.name}`") for cell in reached), row


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_checkpoint_builds_the_decoder_its_cells_name(family, tmp_path):
    llm = kstep.load(write_random_checkpoint(tmp_path / family, family=family, seed=1))
    for column, knobs in SETTINGS:
        cell = _cell(FAMILIES[family], knobs)
        if cell.startswith("refused"):
            with pytest.raises(ValueError, match=cell.removeprefix("refused (").removesuffix(")")):
                llm.resolve(kstep.GenerationParams(max_tokens=64, **knobs))
            continue
        params = llm.resolve(kstep.GenerationParams(max_tokens=64, **knobs))
        decoder = llm.make_decoder([[5, 6, 7]], params)
        built = type(decoder).__name__ if not hasattr(decoder, "exact") else \
            f"{type(decoder).__name__}({type(decoder.exact).__name__})"
        assert built == choose(llm.family, params).name, (family, column)
        assert cell.startswith(f"`{built}`"), (family, column, cell)
