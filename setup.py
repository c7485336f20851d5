"""The one compiled part of shardcache: ``shards._readv`` (shards/native/readv.c), a batch's members
read from the shard files and checked against their XXH3-64 in one call that holds no GIL.

Optional: where it cannot be built (no C compiler), the install goes on and the loaders read with the
pure-Python executor of :mod:`shards.readinto` (same batches, slower with several read threads).
xxHash (BSD-2-Clause, shards/native/xxhash/, from the xxhash 4.1.0 sdist on PyPI) is compiled in, with
its x86 dispatcher choosing AVX2/AVX-512 code at run time where the CPU has it, as python-xxhash does.
"""
import platform

from setuptools import Extension, setup

sources = ["shards/native/readv.c", "shards/native/xxhash/xxhash.c"]
macros = []
if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686"):
    sources.append("shards/native/xxhash/xxh_x86dispatch.c")
    macros.append(("SHARDS_XXH_DISPATCH", "1"))

setup(ext_modules=[Extension("shards._readv", sources, include_dirs=["shards/native"], define_macros=macros,
                             extra_compile_args=["-O3", "-fvisibility=hidden"], optional=True)])
