"""Build hook for the optional native copy kernel (aiokv._native._copy).

Everything else lives in pyproject.toml. The extension is optional: when no C compiler is available aiokv
falls back to a numpy per-block loop (slower for small blocks, same results).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "aiokv._native._copy",
            sources=["aiokv/_native/_copy.c"],
            extra_compile_args=["-O3"],
            optional=True,
        )
    ]
)
