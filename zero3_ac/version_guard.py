"""Which DeepSpeed releases the fork supports, checked without importing DeepSpeed.

docs/compatibility.md has the table of releases, what was measured on each and why the boundaries
are where they are.
"""

from importlib import metadata

SUPPORTED_RANGE = ">=0.18.5,<0.20"
_MIN = (0, 18, 5)
_BELOW = (0, 20, 0)
COMPATIBILITY_DOC = "docs/compatibility.md"

# Why releases below the supported range are refused, newest first: (first release, reason). The
# fork's own hooks run there with engine.backward(loss); DeepSpeed's gradient path around them does not.
_WHY_OLDER = [
    ((0, 18, 3), "runs ZeRO's gradient epilogue too early under reentrant checkpointing when the user calls "
     "loss.backward(), leaving gradients unreduced (fixed in 0.18.5)"),
    ((0, 18, 0), "has no ZeRO gradient epilogue for a user's loss.backward() (added in 0.18.3) and accumulates "
     "ZeRO-1/2 gradients under reentrant checkpointing unlike PyTorch"),
    ((0, 0, 0), "predates the releases whose ZeRO-3 internals the fork was checked against (0.18 and later)"),
]


class UnsupportedDeepSpeedVersion(RuntimeError):
    pass


def installed_deepspeed_version():
    try:
        return metadata.version("deepspeed")
    except metadata.PackageNotFoundError:
        return None


def _release_tuple(version: str):
    parts = []
    for piece in version.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit()) or "0"
        parts.append(int(digits))
    while len(parts) < 3:
        parts.append(0)
    return tuple(parts)


def is_supported(version) -> bool:
    return version is not None and _MIN <= _release_tuple(version) < _BELOW


def why_unsupported(version) -> str:
    """One clause saying why ``version`` is refused ("" when it is supported)."""
    if version is None:
        return "deepspeed is not installed"
    if is_supported(version):
        return ""
    release = _release_tuple(version)
    if release >= _BELOW:
        return (f"deepspeed {version} is installed, newer than the releases the fork was tested with, "
                "whose ZeRO-3 internals it replaces may have changed")
    for first, reason in _WHY_OLDER:
        if release >= first:
            return f"deepspeed {version} is installed, which {reason}"
    return ""


def unsupported_message(version) -> str:
    return (f"zero3_ac supports deepspeed{SUPPORTED_RANGE}, but {why_unsupported(version)} "
            f"(see {COMPATIBILITY_DOC}). Install a supported release (pip install 'deepspeed{SUPPORTED_RANGE}') "
            "or set ZERO3_AC_DISABLE=1 to run stock DeepSpeed.")


def check_supported() -> str:
    version = installed_deepspeed_version()
    if not is_supported(version):
        raise UnsupportedDeepSpeedVersion(unsupported_message(version))
    return version
