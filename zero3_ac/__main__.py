"""``python -m zero3_ac [status|doctor]`` (or ``zero3-ac``): say whether the fork is active here and why.

``status`` (the default) only looks; ``doctor`` also prints the library versions and runs a 2-rank
CPU self-test of the case the fork fixes. ``--help`` and ``--version`` import neither torch nor DeepSpeed.
"""

import argparse
import sys


def status() -> int:
    from zero3_ac import activation, version_guard
    version = version_guard.installed_deepspeed_version()
    print(f"deepspeed: {version or 'not installed'} (supported: {version_guard.SUPPORTED_RANGE})")
    if activation.disabled_by_env():
        print(f"zero3_ac: disabled by {activation.DISABLE_ENV}")
        return 0
    if not version_guard.can_apply(version):
        print("zero3_ac: inactive, " + version_guard.unsupported_message(version))
        return 1
    if not version_guard.is_supported(version):
        print(f"zero3_ac: {version_guard.ALLOW_UNTESTED_ENV}=1 applies the fork to an untested deepspeed")
    import deepspeed  # noqa: F401  (importing it is what activates the fork)
    print(f"zero3_ac: {'active' if activation.is_active() else 'inactive'}")
    return 0 if activation.is_active() else 1


def _version_line() -> str:
    from zero3_ac import __version__, version_guard
    return f"zero3-ac {__version__} (deepspeed {version_guard.installed_deepspeed_version() or 'not installed'})"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="zero3-ac",
        description="Say whether the deepspeed-zero3-ac fork is active in this environment and why (status, the "
        "default); doctor also prints the library versions and runs a 2-rank CPU self-test of the case the fork fixes.")
    parser.add_argument("--version", action="version", version=_version_line())
    parser.add_argument("command", nargs="?", default="status", choices=["status", "doctor"])
    args = parser.parse_args(argv)
    if args.command == "doctor":
        from zero3_ac.doctor import doctor
        return doctor()
    return status()


if __name__ == "__main__":
    sys.exit(main())
