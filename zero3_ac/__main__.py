"""``python -m zero3_ac [status|doctor]`` (or ``zero3-ac``): say whether the fork is active here and why.

``status`` (the default) only looks; ``doctor`` also prints the library versions and runs a 2-rank
CPU self-test of the case the fork fixes.
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
    if not version_guard.is_supported(version):
        print("zero3_ac: inactive, " + version_guard.unsupported_message(version))
        return 1
    import deepspeed  # noqa: F401  (importing it is what activates the fork)
    print(f"zero3_ac: {'active' if activation.is_active() else 'inactive'}")
    return 0 if activation.is_active() else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="zero3-ac", description=__doc__)
    parser.add_argument("command", nargs="?", default="status", choices=["status", "doctor"])
    args = parser.parse_args(argv)
    if args.command == "doctor":
        from zero3_ac.doctor import doctor
        return doctor()
    return status()


if __name__ == "__main__":
    sys.exit(main())
