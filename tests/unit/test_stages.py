"""orchestration/stages.py: the error tag a failed stage run records."""

from __future__ import annotations


def test_the_error_tag_keeps_the_headline_and_the_end_of_a_long_error():
    from orchestration.stages import error_tag

    headline = "Ray job rlhf-sft-1 FAILED (exit code 1): rlhf: error: role 'train' rank 1: the actor died"
    error = RuntimeError(headline + "\n" + "x" * 20000 + "\nlast log line")
    tag = error_tag(error)
    assert len(tag) <= 5000
    assert tag.startswith("RuntimeError: " + headline) and tag.endswith("last log line")
    assert error_tag(ValueError("short")) == "ValueError: short"


def test_the_error_tag_redacts_before_it_cuts(monkeypatch):
    """A credential that the cut would split is still found: redaction runs on the whole text first."""
    from orchestration.stages import error_tag

    secret = "Zq8" + "v" * 40
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    text = "boom\n" + "x" * 6000 + secret + "y" * 4955  # the tail kept (4975 chars) starts inside the secret
    tag = error_tag(RuntimeError(text))
    assert "vvvvvvvvvv" not in tag and "***" in tag
