"""Packaging for deepspeed-zero3-ac.

    pip install .                # non-editable: also installs zero3_ac.pth
    pip install ".[dev]"         # + test / example dependencies

torch must be installed *before* this package (a CPU or CUDA build of your
choice); install_requires only names it, so pip never picks a build for you.

Auto-activation: ``zero3_ac.pth`` (repo root, one line
``import _zero3_ac_autoload``) is copied by ``build_py`` to the root of the
build tree, so the wheel places it at the root of site-packages next to the
``zero3_ac/`` package and the stdlib-only ``_zero3_ac_autoload`` module.
Python's ``site`` module executes ``import`` lines of ``*.pth`` files in
site-packages at every interpreter start-up; that line imports neither torch
nor DeepSpeed, it only arranges for the fork to be applied when ``deepspeed``
is imported. ``pip uninstall`` removes it (it is listed in the wheel's RECORD).

Editable installs (``pip install -e .``) do NOT install the .pth file; use a
non-editable install (scripts/setup_env.sh does) or import zero3_ac yourself.
"""

import os

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
PTH_FILE = "zero3_ac.pth"


def read_version():
    scope = {}
    with open(os.path.join(HERE, "zero3_ac", "version.py")) as fd:
        exec(fd.read(), scope)
    return scope["__version__"]


def fetch_requirements(path):
    with open(os.path.join(HERE, path)) as fd:
        return [
            line.strip() for line in fd
            if line.strip() and not line.lstrip().startswith("#")
        ]


class build_py_with_pth(build_py):
    """build_py that also copies zero3_ac.pth to the root of build_lib."""

    def run(self):
        super().run()
        src = os.path.join(HERE, PTH_FILE)
        if not os.path.isfile(src):
            raise FileNotFoundError(
                f"{PTH_FILE} is missing from the project root ({HERE}); "
                "it is required for auto-activation")
        if getattr(self, "editable_mode", False):
            # PEP 660 editable builds: the .pth would land nowhere useful.
            return
        self.copy_file(src, os.path.join(self.build_lib, PTH_FILE), preserve_mode=0)

    def get_outputs(self, include_bytecode=True):
        outputs = super().get_outputs(include_bytecode=include_bytecode)
        if not getattr(self, "editable_mode", False):
            outputs.append(os.path.join(self.build_lib, PTH_FILE))
        return outputs


setup(
    name="deepspeed-zero3-ac",
    version=read_version(),
    description="Add-on for DeepSpeed ZeRO-3 that patches the upstream engine with a new parameter lifecycle",
    long_description=open(os.path.join(HERE, "README.md")).read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    license_files=["LICENSE"],
    packages=find_packages(include=["zero3_ac", "zero3_ac.*"]),
    py_modules=["_zero3_ac_autoload"],
    include_package_data=False,
    install_requires=fetch_requirements("requirements/requirements.txt"),
    extras_require={"dev": fetch_requirements("requirements/requirements-dev.txt")},
    python_requires=">=3.10",
    entry_points={"console_scripts": ["zero3-ac = zero3_ac.__main__:main"]},
    cmdclass={"build_py": build_py_with_pth},
    zip_safe=False,
    classifiers=[
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3.10",
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
    ],
)
