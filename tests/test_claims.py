"""Claims as checks: ✓ or ✗ with the evidence; a failed claim is flagged at the cpu and gpu scales only."""

import pytest

from helpers.measure.claims import claim, claims_in_text


def test_a_held_claim_prints_a_tick_with_its_evidence(capsys):
    assert claim("A is faster than B", True, "2.00x", scale="cpu") is None  # a cell ending in a claim shows no value
    out, err = capsys.readouterr()
    assert out == "✓ A is faster than B: 2.00x\n" and err == ""


@pytest.mark.parametrize("scale", ["cpu", "gpu"])
def test_a_failed_claim_is_flagged_on_stderr(capsys, scale):
    claim("A is faster than B", False, "0.90x", scale=scale)
    out, err = capsys.readouterr()
    assert out == ""
    assert err == "✗ A is faster than B: 0.90x  <- does not hold on this machine\n"


def test_at_smoke_scale_a_failed_claim_is_reported_not_flagged(capsys):
    claim("A is faster than B", False, "0.90x", scale="smoke")
    out, err = capsys.readouterr()
    assert err == "" and out.startswith("✗ A is faster than B: 0.90x (smoke scale")


def test_claims_are_read_back_from_output_text():
    text = "table\n✓ A: 1\n✗ B: 2  <- does not hold on this machine\n✓notaclaim\n"
    assert claims_in_text(text) == [(True, "✓ A: 1"), (False, "✗ B: 2")]
