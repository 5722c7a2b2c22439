"""Build hook for the optional native extensions: the copy kernel (aiokv._native._copy) and chained block
hashing (aiokv._native._sha).

Everything else lives in pyproject.toml. Both extensions are optional: when no C compiler is available aiokv
falls back to a numpy per-block loop for copies and to hashlib for hashes (slower, same results).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "aiokv._native._copy",
            sources=["aiokv/_native/_copy.c"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
        Extension(
            "aiokv._native._sha",
            sources=["aiokv/_native/_sha.c"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
    ]
)
