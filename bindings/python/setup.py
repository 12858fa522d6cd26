"""Builds the `sparsa` wheel with libsparsa.so inside the package folder (where sparsa/_library.py looks first).

Which library goes in:
- SPARSA_BUILD_DIR=<a built CMake tree of this repository>: its libsparsa.so, with whatever backends that build has
  (a build with -DSPARSA_CUDA=ON carries the CUDA backend; the library is one file either way);
- otherwise a CMake build of this checkout into <repo>/build/python-wheel, of the library only: CPU backend, plus
  the CUDA backend when SPARSA_WHEEL_CUDA=ON (nvcc needed; that compile takes far longer).
Only setuptools and wheel are needed (Debian's python3-setuptools and python3-wheel); nothing is downloaded.
"""
import os
import re
import shutil
import subprocess
import sys
import sysconfig

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

try:
    from wheel.bdist_wheel import bdist_wheel
except ImportError:  # building an sdist or installing without the wheel package
    bdist_wheel = None

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
LIBRARY_FILE = "libsparsa.so"
PACKAGED_NAME = "libsparsa.so.0"  # the library's soname: what the package's loader finds by its glob
WHEEL_BUILD_DIR = os.path.join(REPO, "build", "python-wheel")


def project_version():
    """The version of CMakeLists.txt's project() call: the library's version, which the wheel carries."""
    with open(os.path.join(REPO, "CMakeLists.txt"), encoding="utf-8") as f:
        match = re.search(r"project\(\s*sparsa\s+VERSION\s+([0-9][0-9.]*)", f.read())
    if not match:
        sys.exit("sparsa setup.py: no `project(sparsa VERSION x.y.z)` in " + os.path.join(REPO, "CMakeLists.txt"))
    return match.group(1)


def built_library():
    """The path of the libsparsa.so to package, building it when no build folder is given."""
    build_dir = os.environ.get("SPARSA_BUILD_DIR")
    if not build_dir:
        build_dir = WHEEL_BUILD_DIR
        cuda = "ON" if os.environ.get("SPARSA_WHEEL_CUDA", "OFF").upper() in ("1", "ON", "TRUE", "YES") else "OFF"
        configure = ["cmake", "-S", REPO, "-B", build_dir, "-DCMAKE_BUILD_TYPE=Release", f"-DSPARSA_CUDA={cuda}",
                     "-DSPARSA_HIP=OFF", "-DSPARSA_BUILD_TESTS=OFF", "-DSPARSA_BUILD_TOOLS=OFF",
                     "-DSPARSA_BUILD_BENCH=OFF", "-DSPARSA_BUILD_BINDINGS=OFF"]
        print("sparsa setup.py:", " ".join(configure), flush=True)
        subprocess.run(configure, check=True)
        subprocess.run(["cmake", "--build", build_dir, "--target", "sparsa", "-j", str(os.cpu_count() or 2)],
                       check=True)
    path = os.path.join(os.path.abspath(build_dir), LIBRARY_FILE)
    if not os.path.exists(path):
        sys.exit(f"sparsa setup.py: SPARSA_BUILD_DIR={build_dir} has no {LIBRARY_FILE} (build it first: "
                 f"cmake --build {build_dir} --target sparsa)")
    return os.path.realpath(path)  # the versioned file, not the symlink


class BuildPyWithLibrary(build_py):
    """The ordinary build_py, then libsparsa.so copied into the built package as libsparsa.so.0."""

    def run(self):
        super().run()
        if self.dry_run:
            return
        target = os.path.join(self.build_lib, "sparsa", PACKAGED_NAME)
        source = built_library()
        print(f"sparsa setup.py: packaging {source} as sparsa/{PACKAGED_NAME}", flush=True)
        shutil.copyfile(source, target)


commands = {"build_py": BuildPyWithLibrary}
if bdist_wheel is not None:
    class PlatformWheel(bdist_wheel):
        """A native library inside: the wheel is for this platform, but any Python 3 (no extension module)."""

        def get_tag(self):
            return "py3", "none", sysconfig.get_platform().replace("-", "_").replace(".", "_")

    commands["bdist_wheel"] = PlatformWheel



class NativeDistribution(Distribution):
    """Has a native part (libsparsa.so): the package goes in platlib, and the wheel is not tagged pure."""

    def has_ext_modules(self):
        return True


setup(version=project_version(), cmdclass=commands, distclass=NativeDistribution)
