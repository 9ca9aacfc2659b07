"""``python -m zero3_ac doctor``: versions, whether the fork is active and why, and a 2-rank CPU self-test.

Exits 0 only when the fork is active and the self-test passed in every rank.
"""

from importlib import metadata

PACKAGES = ("torch", "deepspeed", "transformers", "peft")


def _version(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def fork_state():
    """(usable, line): whether the fork runs in this environment, and a sentence saying why or why not."""
    from zero3_ac import __version__, activation, version_guard
    version = version_guard.installed_deepspeed_version()
    if activation.disabled_by_env():
        return False, f"zero3_ac {__version__}: disabled by {activation.DISABLE_ENV}=1 (DeepSpeed runs stock)"
    if not version_guard.can_apply(version):
        return False, f"zero3_ac {__version__}: inactive, " + version_guard.unsupported_message(version)
    try:
        import deepspeed  # noqa: F401  (importing it is what activates the fork)
    except Exception as error:
        return False, f"zero3_ac {__version__}: inactive, importing deepspeed {version} failed: {error!r}"
    if not activation.is_active():
        return False, (f"zero3_ac {__version__}: inactive although deepspeed {version} is supported: importing "
                       "deepspeed did not apply it (installed editable, without zero3_ac.pth? Install with "
                       "`pip install .`, or call zero3_ac.apply())")
    return True, f"zero3_ac {__version__}: active on deepspeed {version} (per-invocation ZeRO-3 lifecycle)"


def run_self_test() -> bool:
    from zero3_ac import self_test
    print(f"self-test: {self_test.WORLD_SIZE} CPU ranks (gloo), ZeRO-3, frozen blocks with trainable adapters, "
          f"non-reentrant checkpointing, {self_test.STEPS} steps ...", flush=True)
    passed = True
    for report in self_test.run():
        problems = self_test.failures(report)
        passed = passed and not problems
        if problems:
            print(f"  rank {report['rank']}: FAIL: " + "; ".join(problems))
        else:
            losses = ", ".join(f"{loss:.4f}" for loss in report["losses"])
            print(f"  rank {report['rank']}: ok (losses {losses}; no param left gathered, no frozen re-gather)")
    print(f"self-test: {'PASS' if passed else 'FAIL'}")
    return passed


def doctor() -> int:
    from zero3_ac import version_guard
    for name in PACKAGES:
        version = version_guard.installed_deepspeed_version() if name == "deepspeed" else _version(name)
        print(f"{name}: {version or 'not installed'}")
    print(f"supported deepspeed: {version_guard.SUPPORTED_RANGE}")
    usable, line = fork_state()
    print(line)
    if not version_guard.can_apply(version_guard.installed_deepspeed_version()):
        print("self-test: skipped (unsupported deepspeed)")
        return 1
    passed = run_self_test()
    return 0 if usable and passed else 1
