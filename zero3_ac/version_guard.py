"""Which DeepSpeed releases the fork supports, checked without importing DeepSpeed."""

from importlib import metadata

SUPPORTED_RANGE = ">=0.19.2,<0.20"
_MIN = (0, 19, 2)
_BELOW = (0, 20, 0)


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


def unsupported_message(version) -> str:
    found = "is not installed" if version is None else f"{version} is installed"
    return (f"zero3_ac supports deepspeed{SUPPORTED_RANGE}, but deepspeed {found}. "
            f"Install a supported release (pip install 'deepspeed{SUPPORTED_RANGE}') "
            f"or set ZERO3_AC_DISABLE=1 to run stock DeepSpeed.")


def check_supported() -> str:
    version = installed_deepspeed_version()
    if not is_supported(version):
        raise UnsupportedDeepSpeedVersion(unsupported_message(version))
    return version
