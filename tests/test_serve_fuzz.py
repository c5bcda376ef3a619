"""Schema fuzz of ``hsdp serve`` in the suite (issue 27): ``benchmarks/serve_fuzz.py`` (schemathesis against
``/openapi.json``, valid and invalid requests for every operation) against a diffusion server and an LM server,
a few examples per operation: no answer is a 5xx."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.multirank]  # benchmarks.serve_fuzz starts the servers

MAX_EXAMPLES = 5
"""Per operation and phase: each server answers a few hundred requests in about a minute."""


@pytest.mark.parametrize("model", ["tiny-wan", "tiny-llama"])
def test_schema_fuzz_gets_no_server_error(model, tmp_path):
    pytest.importorskip("schemathesis")  # the dev extra
    from benchmarks.serve_fuzz import fuzz

    row = fuzz(model, tmp_path, MAX_EXAMPLES, seed=0)
    assert row["cases"] > 0, row["summary"]
    log = (tmp_path / model / "server.log").read_text().splitlines()
    errors = [line for line in log if '" 5' in line and "HTTP/1.1" in line]
    assert row["server_5xx_in_log"] == 0 and "not_a_server_error" not in row["failures"], (errors[:5], row)
