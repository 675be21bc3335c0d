"""Build of the vmmt Python package: the C extension vmmt._vmmt with the
library's C sources compiled in, so the installed package needs nothing else
(libcuda is still loaded at run time, never linked).

setuptools is the backend because it is the one that builds C extensions
offline with what Debian ships (python3-setuptools); no CMake or
scikit-build is needed. Works from this directory (`pip install ./python`)
and from the repository root (`pip install .`, through ../setup.py).
"""
import glob
import os

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def rel(path):
    """setuptools wants source paths relative to the directory it runs in."""
    return os.path.relpath(path, os.getcwd())


# group_mpi.c is the MPI adapter, built only where MPI is (libvmmt_mpi, CMakeLists.txt).
LIB_SOURCES = sorted(p for p in glob.glob(os.path.join(ROOT, "src", "*", "*.c"))
                     if os.path.basename(p) != "group_mpi.c")
EXT_SOURCES = sorted(glob.glob(os.path.join(HERE, "src", "*.c")))
# The emulated driver (emu/) is its own libvmmt_emu.so, shipped beside the
# extension: the library dlopens it for VMMT_DRIVER=emu, looking beside the
# object that holds the library's code (this extension) first, and the tests
# read its live counters there with ctypes (python/tests/emu_counters.py).
EMU_SOURCES = sorted(glob.glob(os.path.join(ROOT, "emu", "*.c")))

CFLAGS = ["-std=c11", "-fvisibility=hidden", "-Wall", "-Wextra", "-Wno-unused-parameter",
          "-Wno-missing-field-initializers", "-Wno-cast-function-type"]
# Messages are cut to fixed buffers on purpose (as in CMakeLists.txt).
if os.environ.get("CC", "gcc").endswith("gcc") or "CC" not in os.environ:
    CFLAGS.append("-Wno-format-truncation")
MACROS = [("_GNU_SOURCE", None), ("VMMT_API", "")]
# The library's parts that every part sees (CMakeLists.txt, VMMT_SHARED_PARTS); a
# producer or consumer file finds its own part's headers beside itself.
# The extension's pool keeper (python/src/pool_keep.c) reads the producer's
# table itself, so it sees the producer's headers too; the CMake build, which
# compiles the library apart, is what keeps producer and consumer apart.
SHARED_PARTS = ["common", "driver", "wire", "broker", "producer"]
INCLUDES = ([rel(os.path.join(ROOT, "include"))] +
            [rel(os.path.join(ROOT, "src", part)) for part in SHARED_PARTS] +
            [rel(os.path.join(HERE, "src"))])


class BuildExt(build_ext):
    """build_ext, plus libvmmt_emu.so beside the extension."""

    def run(self):
        super().run()
        pkg_dir = os.path.join(HERE, "vmmt") if self.inplace else os.path.join(self.build_lib,
                                                                                 "vmmt")
        objects = self.compiler.compile(
            [rel(p) for p in EMU_SOURCES], output_dir=self.build_temp, macros=MACROS,
            include_dirs=[rel(os.path.join(ROOT, "emu"))] + INCLUDES,
            extra_postargs=CFLAGS + ["-fPIC"])
        self.compiler.link_shared_object(objects, os.path.join(pkg_dir, "libvmmt_emu.so"),
                                         libraries=["pthread"])


setup(
    name="vmmt",
    version="0.1.0",
    description="GPU buffers between processes through CUDA VMM, for any DLPack array library",
    packages=["vmmt"],
    package_dir={"vmmt": rel(os.path.join(HERE, "vmmt"))},
    package_data={"vmmt": ["*.pyi", "py.typed"]},
    python_requires=">=3.9",
    ext_modules=[
        Extension(
            "vmmt._vmmt",
            sources=[rel(p) for p in LIB_SOURCES + EXT_SOURCES],
            include_dirs=INCLUDES,
            define_macros=MACROS + [("Py_LIMITED_API", "0x03090000")],
            extra_compile_args=CFLAGS,
            libraries=["dl", "pthread"],
            py_limited_api=True,
        )
    ],
    cmdclass={"build_ext": BuildExt},
    # Build under python/build even from the root, whose build/ is CMake's.
    options={"bdist_wheel": {"py_limited_api": "cp39"},
             "build": {"build_base": rel(os.path.join(HERE, "build"))}},
)
