"""Build hook for the optional native helpers: the copy kernel (aiokv._native._copy) and the C fast path of
Request.step (aiokv._native._step).

Everything else lives in pyproject.toml. Both extensions are optional: when no C compiler is available aiokv
falls back to a numpy per-block copy loop and to the Python step method (slower, same results).
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
            "aiokv._native._step",
            sources=["aiokv/_native/_step.c"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
    ]
)
