"""The supported DeepSpeed range and what the guard says at each of its boundaries."""

from pathlib import Path

import pytest

from zero3_ac import version_guard

REQUIREMENTS = Path(__file__).resolve().parents[2] / "requirements" / "requirements.txt"


@pytest.mark.parametrize("version, supported", [("0.18.5", True), ("0.18.6", True), ("0.18.9", True),
                                                 ("0.19.2", True), ("0.19.8", True), ("0.19.10+abc", True),
                                                 ("0.19.9rc1", True), ("0.19.9.dev0+g1234", True),
                                                 ("0.18.4", False), ("0.18.5rc1", False), ("0.18.3", False),
                                                 ("0.18.0", False), ("0.17.6", False), ("0.20.0", False),
                                                 ("0.20.0.dev0", False), ("1.0.0", False), ("master", False),
                                                 (None, False)])
def test_supported_range(version, supported):
    assert version_guard.is_supported(version) == supported
    assert (version_guard.why_unsupported(version) == "") == supported


@pytest.mark.parametrize("version, reason", [
    ("0.18.4", "too early under reentrant checkpointing"),
    ("0.18.3", "fixed in 0.18.5"),
    ("0.18.2", "no ZeRO gradient epilogue for a user's loss.backward()"),
    ("0.18.0", "ZeRO-1/2 gradients under reentrant checkpointing"),
    ("0.17.6", "predates the releases"),
    ("0.20.0", "newer than the releases the fork was tested with"),
    ("0.20.0.dev0", "newer than the releases the fork was tested with"),
    ("master", "newer than the releases the fork was tested with (or not a release)"),
    (None, "deepspeed is not installed"),
])
def test_unsupported_message_says_why_and_how_to_fix(version, reason):
    message = version_guard.unsupported_message(version)
    assert reason in message
    if version is not None:
        assert f"deepspeed {version} is installed" in message
    assert f"zero3_ac supports deepspeed{version_guard.SUPPORTED_RANGE}" in message
    assert f"pip install 'deepspeed{version_guard.SUPPORTED_RANGE}'" in message
    assert "ZERO3_AC_DISABLE=1" in message
    assert ".md" not in message  # self-contained: the wheel ships no docs


@pytest.mark.parametrize("version, untested", [("0.20.0", True), ("0.20.0.dev0", True), ("1.0.0", True),
                                                ("master", True), ("0.19.8", False), ("0.18.3", False),
                                                ("0.17.6", False), (None, False)])
def test_only_untested_releases_can_be_allowed(version, untested, monkeypatch):
    monkeypatch.delenv(version_guard.ALLOW_UNTESTED_ENV, raising=False)
    assert version_guard.is_untested(version) == untested
    assert (f"{version_guard.ALLOW_UNTESTED_ENV}=1" in version_guard.unsupported_message(version)) == untested
    assert version_guard.can_apply(version) == version_guard.is_supported(version)
    monkeypatch.setenv(version_guard.ALLOW_UNTESTED_ENV, "1")
    assert version_guard.can_apply(version) == (version_guard.is_supported(version) or untested)


def test_the_install_requirement_is_the_supported_range():
    requirements = REQUIREMENTS.read_text().split()
    assert f"deepspeed{version_guard.SUPPORTED_RANGE}" in requirements
