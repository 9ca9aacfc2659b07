"""Which DeepSpeed releases the fork supports, checked without importing DeepSpeed.

The messages are self-contained (they name the range and the fix); docs/compatibility.md has the
table of releases, what was measured on each and why the boundaries are where they are.
"""

import os
from importlib import metadata

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

SUPPORTED_RANGE = ">=0.18.5,<0.20"
_SUPPORTED = SpecifierSet(SUPPORTED_RANGE)
ALLOW_UNTESTED_ENV = "ZERO3_AC_ALLOW_UNTESTED"

# Why releases below the supported range are refused, newest first: (first release, reason). The
# fork's own hooks run there with engine.backward(loss); DeepSpeed's gradient path around them does not.
_WHY_OLDER = [
    (Version("0.18.3"), "runs ZeRO's gradient epilogue too early under reentrant checkpointing when the user calls "
     "loss.backward(), leaving gradients unreduced (fixed in 0.18.5)"),
    (Version("0.18.0"), "has no ZeRO gradient epilogue for a user's loss.backward() (added in 0.18.3) and "
     "accumulates ZeRO-1/2 gradients under reentrant checkpointing unlike PyTorch"),
    (Version("0"), "predates the releases whose ZeRO-3 internals the fork was checked against (0.18 and later)"),
]


class UnsupportedDeepSpeedVersion(RuntimeError):
    pass


def installed_deepspeed_version():
    try:
        return metadata.version("deepspeed")
    except metadata.PackageNotFoundError:
        return None


def _parse(version):
    try:
        return Version(version)
    except (InvalidVersion, TypeError):
        return None


def is_supported(version) -> bool:
    """Whether ``version`` is in the tested range (pre-releases and local builds of it included)."""
    parsed = _parse(version)
    return parsed is not None and _SUPPORTED.contains(parsed, prereleases=True)


def is_untested(version) -> bool:
    """Installed, and newer than the tested range or not a PEP 440 version (a source build, master)."""
    if version is None or is_supported(version):
        return False
    parsed = _parse(version)
    return parsed is None or not any(parsed < Version(spec.version) for spec in _SUPPORTED if spec.operator == ">=")


def untested_allowed() -> bool:
    return os.environ.get(ALLOW_UNTESTED_ENV, "").strip().lower() not in ("", "0", "false", "no")


def can_apply(version) -> bool:
    """Supported, or untested and allowed by ``ZERO3_AC_ALLOW_UNTESTED=1``."""
    return is_supported(version) or (is_untested(version) and untested_allowed())


def why_unsupported(version) -> str:
    """One clause saying why ``version`` is refused ("" when it is supported)."""
    if version is None:
        return "deepspeed is not installed"
    if is_supported(version):
        return ""
    if is_untested(version):
        return (f"deepspeed {version} is installed, newer than the releases the fork was tested with (or not a "
                "release), whose ZeRO-3 internals it replaces may have changed")
    parsed = _parse(version)
    for first, reason in _WHY_OLDER:
        if parsed >= first:
            return f"deepspeed {version} is installed, which {reason}"
    return ""


def unsupported_message(version) -> str:
    fixes = f"Install a supported release (pip install 'deepspeed{SUPPORTED_RANGE}')"
    if is_untested(version):
        fixes += (f", set {ALLOW_UNTESTED_ENV}=1 to apply the fork to this untested release anyway (compare its "
                  "losses with a ZERO3_AC_DISABLE=1 run)")
    return (f"zero3_ac supports deepspeed{SUPPORTED_RANGE}, but {why_unsupported(version)}. "
            f"{fixes}, or set ZERO3_AC_DISABLE=1 to run stock DeepSpeed.")


def untested_warning(version) -> str:
    return (f"zero3_ac: {ALLOW_UNTESTED_ENV}=1: applying the fork to deepspeed {version}, which it was NOT tested "
            f"with (tested: deepspeed{SUPPORTED_RANGE}). The ZeRO-3 internals it replaces may have changed: compare "
            "losses and memory with a ZERO3_AC_DISABLE=1 run before trusting the results.")


def check_supported() -> str:
    """The installed DeepSpeed version, if the fork may be applied to it; raises otherwise."""
    version = installed_deepspeed_version()
    if not can_apply(version):
        raise UnsupportedDeepSpeedVersion(unsupported_message(version))
    return version
