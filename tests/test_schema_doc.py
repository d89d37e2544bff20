"""docs/SCHEMA.md documents every column with its type, and nothing that is not there."""

from __future__ import annotations

import re

from gpuwatch.recording import schema

from conftest import ROOT


def test_schema_doc_matches_code():
    doc = (ROOT / "docs" / "SCHEMA.md").read_text()
    assert f"(version {schema.SCHEMA_VERSION})" in doc
    sections = re.split(r"^## ", doc, flags=re.M)
    for table, cols in schema.TABLES.items():
        sec = next(s for s in sections if s.startswith(table))
        documented = dict(re.findall(r"^\| `(\w+)` \| ([^|]+?) \|", sec, flags=re.M))
        assert set(documented) == set(cols), table
        for name, dtype in cols.items():
            if name != "ts":
                assert documented[name].replace(" ", "") .startswith(str(dtype).split("(")[0].replace(" ", "")), (table, name)
    for kind in schema.EVENT_KINDS:
        assert f"`{kind}`" in doc
